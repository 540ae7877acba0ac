#!/usr/bin/env python3
"""Checks pipeline/scan.c's forward_move_live against a simulation of the scan's data flow.

The simulation replays the forward loop of tw_pipeline_forward block by block: every block gets
an id, a move makes a child of the block it sends, and a read is recorded where the scan reads a
block (a valid iteration's stage input, and every state_io column at the end). A move is needed
iff its child or a descendant is read. The rule below is forward_move_live written again; the
script reports a move the rule leaves out although it is read (wrong results: must be 0) and a
move the rule keeps although nothing reads it (lost speed only).

    python3 pipeline/move_liveness_sim.py     # S <= 5, d = 1 and 2, R <= 3, M = S .. 4S
"""
import itertools
import sys


def simulate(S, M, R, d):
    """{(t, kind, sender): needed} for every move the forward makes."""
    mps, T = M // S, M * R + d * (S - 1)
    circ, rotate = R > 1 and M > d * S, R > 1 and not M > d * S
    ids, parent, read, made = itertools.count(), {}, set(), []
    ZERO = -1

    def new(p=None):
        n = next(ids)
        parent[n] = p
        return n

    def valid(t, s):
        return 0 <= t - d * s < M * R

    def move(t, kind, s, v):
        c = new(v)
        made.append((t, kind, s, c, v))
        return c

    state = [[new() for _ in range(mps)] for _ in range(S)]
    shift, mover, out, prev, circb = [ZERO] * S, [ZERO] * S, [ZERO] * S, [ZERO] * S, [ZERO] * M
    for t in range(T):
        c = t % mps
        for s in range(S):
            x = state[0][c] if s == 0 and t < M else circb[t % M] if s == 0 and circ else shift[s]
            if valid(t, s):
                read.add(x)
                out[s] = new()
            else:
                out[s] = ZERO
        send = [prev[s] if d == 2 else out[s] for s in range(S)]
        nshift, tmp2, tmp = [ZERO] * S, [ZERO] * S, [ZERO] * S
        for s in range(S):
            dst = (s + 1) % S if rotate else (s + 1 if s + 1 < S else None)
            if dst is not None:
                nshift[dst] = move(t, "right", s, send[s])
            if s >= 1:
                tmp2[s - 1] = move(t, "left", s, state[s][c])
            if circ and s == S - 1:
                tmp[0] = move(t, "last_to_first", s, mover[s])
        shift = nshift
        for s in range(S):
            if circ and s == 0:
                circb[((t - d * (S - 1) - 1) % M + M) % M] = tmp[0]
            if circ:
                mover[s] = out[s]
            state[s][c] = out[s] if s == S - 1 else tmp2[s]
            if d == 2:
                prev[s] = out[s]
    for s in range(S):
        read.update(state[s])
    children = {}
    for n, p in parent.items():
        if p is not None:
            children.setdefault(p, []).append(n)
    memo = {}

    def needed(n):
        if n not in memo:
            memo[n] = n in read or any(needed(ch) for ch in children.get(n, []))
        return memo[n]

    return {(t, k, s): v != ZERO and needed(c) for (t, k, s, c, v) in made}


def rule(S, M, R, d, t, kind, s):
    """forward_move_live of pipeline/scan.c."""
    mps, T = M // S, M * R + d * (S - 1)

    def valid(tt, ss):
        return 0 <= tt - d * ss < M * R

    if kind == "right":
        return valid(t - (d - 1), s)
    if kind == "last_to_first":
        return valid(t - 1, S - 1) and (t - 1 - d * (S - 1)) // M < R - 1
    col, u = t % mps, t // mps
    return s + u <= S - 1 or u + s >= (T - col + mps - 1) // mps


def main():
    sys.setrecursionlimit(100000)
    wrong = kept = left_out = total = 0
    for S in range(1, 6):
        for d in (1, 2):
            for R in (1, 2, 3):
                for M in range(S, 4 * S + 1, S):
                    for (t, k, s), need in simulate(S, M, R, d).items():
                        live = rule(S, M, R, d, t, k, s)
                        total += 1
                        wrong += need and not live
                        kept += live and not need
                        left_out += not live
    print(f"{total} moves: {left_out} left out by the rule, {wrong} of them read (must be 0), "
          f"{kept} kept that nothing reads")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
