/* The sharding rules of MoE routing (tw_shard_ep.h): router, ep_dispatch, ep_combine. */
#include <stdio.h>
#include <string.h>

#include "twin/tw_shard_ep.h"

static const char *const op_names[TW_EP_OP_COUNT] = {"router", "ep_dispatch", "ep_combine"};

const char *tw_ep_op_name(tw_ep_op op) { return ((int)op >= 0 && op < TW_EP_OP_COUNT) ? op_names[op] : "?"; }

int tw_ep_op_from_name(const char *name, tw_ep_op *out) {
  for (int i = 0; name && i < TW_EP_OP_COUNT; i++)
    if (strcmp(name, op_names[i]) == 0) {
      *out = (tw_ep_op)i;
      return 0;
    }
  return -1;
}

static tw_status rule(const char *name, const char *fmt_what, const tw_pspec *p) {
  char sb[128];
  return tw_error(TW_ERR_INVALID_ARG, "rule %s: %s (spec %s)", name, fmt_what, tw_pspec_str(p, sb, sizeof sb));
}

static int has_axis(const tw_dimspec *d, tw_axis a) {
  for (int i = 0; i < d->n; i++)
    if (d->axis[i] == a) return 1;
  return 0;
}

/* Ranks that hold a token shard twice: the mesh axes of size > 1 outside dim 0's spec. */
static int replicas_of(const tw_mesh *m, const tw_dimspec *d) {
  int r = 1;
  for (int i = 0; i < m->naxes; i++)
    if (!has_axis(d, m->axis[i])) r *= m->size[i];
  return r;
}

static void note(tw_ep_plan *p, const char *text) {
  if (p->nnotes < 4) snprintf(p->notes[p->nnotes++], sizeof p->notes[0], "%s", text);
}

tw_status tw_ep_plan_make(const tw_mesh *mesh, tw_ep_op op, int64_t tokens, int64_t hidden,
                          int num_experts, int topk, const tw_pspec *x_spec,
                          const tw_pspec *idx_spec, const tw_pspec *w_spec, tw_ep_plan *plan) {
  if (!mesh || !x_spec || !plan) return tw_error(TW_ERR_NULL, "ep plan: mesh, x_spec or plan is NULL");
  if ((int)op < 0 || op >= TW_EP_OP_COUNT) return tw_error(TW_ERR_INVALID_ARG, "ep plan: unknown op %d", (int)op);
  memset(plan, 0, sizeof *plan);
  plan->op = op;
  plan->mesh = *mesh;
  plan->tokens = tokens;
  plan->hidden = hidden;
  plan->num_experts = num_experts;
  plan->topk = topk;
  plan->x_spec = *x_spec;
  if (tokens < 0 || hidden < 1 || num_experts < 1 || topk < 1 || topk > num_experts)
    return tw_error(TW_ERR_INVALID_ARG, "ep plan %s: T = %lld, H = %lld, E = %d, k = %d (need T >= 0, H >= 1, 1 <= k <= E)",
                    tw_ep_op_name(op), (long long)tokens, (long long)hidden, num_experts, topk);
  const tw_dimspec *d0 = &x_spec->dim[0];
  if (op == TW_EP_OP_ROUTER) {
    int64_t shape[2] = {tokens, num_experts};
    TW_TRY(tw_pspec_check(mesh, x_spec, 2, shape, "logits"));
    if (x_spec->dim[1].n)
      return rule("router.experts_replicated", "the expert dim of logits must not be sharded", x_spec);
    plan->outer = *d0;
    plan->num_groups = tw_dimspec_shards(mesh, d0);
    plan->ep_size = 1;
    plan->replicas = replicas_of(mesh, d0);
    plan->local_tokens = tokens / plan->num_groups;
    plan->out_spec = *x_spec;
    if (d0->n) note(plan, "aux loss: its per-expert sums over tokens are all-reduced over dim 0's axes (global T)");
    return TW_OK;
  }
  int64_t xs[2] = {tokens, hidden}, ks[2] = {tokens, topk};
  /* rank first: a spec of the wrong rank is a spec error, not a rule */
  TW_TRY(tw_pspec_check(mesh, x_spec, 2, xs, "tokens"));
  const tw_pspec *specs[2] = {idx_spec ? idx_spec : x_spec, w_spec ? w_spec : x_spec};
  const char *names[2] = {"topk_idx", "topk_weights"};
  for (int i = 0; i < 2; i++) {
    if (specs[i] != x_spec) TW_TRY(tw_pspec_check(mesh, specs[i], 2, ks, names[i]));
    if (specs[i]->dim[1].n) return rule("ep.leading_dim_only", "only the token dim may be sharded", specs[i]);
    tw_pspec a = *specs[i], b = *x_spec;
    a.dim[1].n = b.dim[1].n = 0;
    if (!tw_pspec_equal(&a, &b)) {
      char sa[128], sb[128];
      return tw_error(TW_ERR_INVALID_ARG, "rule ep.specs_equal: %s's token dim %s differs from the tokens' %s", names[i],
                      tw_pspec_str(specs[i], sa, sizeof sa), tw_pspec_str(x_spec, sb, sizeof sb));
    }
  }
  if (x_spec->dim[1].n) return rule("ep.leading_dim_only", "only the token dim may be sharded, not H", x_spec);
  for (int i = 0; i < d0->n; i++)
    if (d0->axis[i] != TW_AXIS_DP && d0->axis[i] != TW_AXIS_FSDP && d0->axis[i] != TW_AXIS_EP) {
      char m[96];
      snprintf(m, sizeof m, "the token dim may use dp, fsdp and ep only, not '%s'", tw_axis_name(d0->axis[i]));
      return rule("ep.axes", m, x_spec);
    }
  if (!has_axis(d0, TW_AXIS_EP)) return rule("ep.needs_ep", "the token dim must be sharded by ep (use ep=1 for none)", x_spec);
  if (d0->axis[d0->n - 1] != TW_AXIS_EP) return rule("ep.ep_innermost", "ep must be the last (minor) axis of the token dim", x_spec);
  plan->ep_size = tw_mesh_axis_size(mesh, TW_AXIS_EP);
  if (num_experts % plan->ep_size != 0) {
    char m[96];
    snprintf(m, sizeof m, "E = %d is not divisible by |ep| = %d", num_experts, plan->ep_size);
    return rule("ep.experts_divisible", m, x_spec);
  }
  plan->outer = *d0;
  plan->outer.n--;
  plan->num_groups = tw_dimspec_shards(mesh, &plan->outer);
  plan->replicas = replicas_of(mesh, d0);
  plan->local_tokens = tokens / (plan->num_groups * plan->ep_size);
  plan->recv_spec.ndim = 2;
  plan->recv_spec.dim[0] = *d0;
  plan->out_spec = *x_spec;
  char m[160];
  snprintf(m, sizeof m, "%d EP group(s) of %d rank(s)%s", plan->num_groups * plan->replicas, plan->ep_size,
           plan->replicas > 1 ? "; axes outside the token spec hold replicas that route the same tokens" : "");
  note(plan, m);
  return TW_OK;
}

int tw_ep_plan_shard(const tw_ep_plan *p, int rank) { return tw_dimspec_index(&p->mesh, &p->x_spec.dim[0], rank); }

int tw_ep_plan_group(const tw_ep_plan *p, int rank, int *ep_rank) {
  /* every coordinate but ep, row-major over the mesh */
  int g = 0;
  for (int i = 0; i < p->mesh.naxes; i++)
    if (p->mesh.axis[i] != TW_AXIS_EP || p->op == TW_EP_OP_ROUTER)
      g = g * p->mesh.size[i] + tw_mesh_coord(&p->mesh, rank, p->mesh.axis[i]);
  if (ep_rank) *ep_rank = p->op == TW_EP_OP_ROUTER ? 0 : tw_mesh_coord(&p->mesh, rank, TW_AXIS_EP);
  return g;
}

const char *tw_ep_plan_format(const tw_ep_plan *p, char *buf, size_t n) {
  char mb[96], xs[128], rs[128], os[128];
  size_t u = 0;
  if (!buf || n == 0) return "";
  u += (size_t)snprintf(buf + u, n - u, "op %s on mesh %s\n", tw_ep_op_name(p->op), tw_mesh_str(&p->mesh, mb, sizeof mb));
  if (p->op == TW_EP_OP_ROUTER) {
    if (u < n)
      u += (size_t)snprintf(buf + u, n - u, "  logits [%lld, %d] %s -> local [%lld, %d]; no collectives\n",
                            (long long)p->tokens, p->num_experts, tw_pspec_str(&p->x_spec, xs, sizeof xs),
                            (long long)p->local_tokens, p->num_experts);
  } else if (u < n) {
    u += (size_t)snprintf(buf + u, n - u,
                          "  tokens [%lld, %lld] %s -> local [%lld, %lld], topk k = %d, E = %d (%d per rank)\n"
                          "  EP groups: ranks sharing every non-ep coordinate; |ep| = %d, %d group(s) x %d replica(s)\n"
                          "  %s: recv [groups*ep*R, H] %s, out %s\n",
                          (long long)p->tokens, (long long)p->hidden, tw_pspec_str(&p->x_spec, xs, sizeof xs),
                          (long long)p->local_tokens, (long long)p->hidden, p->topk, p->num_experts,
                          p->num_experts / p->ep_size, p->ep_size, p->num_groups, p->replicas, tw_ep_op_name(p->op),
                          tw_pspec_str(&p->recv_spec, rs, sizeof rs), tw_pspec_str(&p->out_spec, os, sizeof os));
  }
  for (int i = 0; i < p->nnotes && u < n; i++) u += (size_t)snprintf(buf + u, n - u, "  note: %s\n", p->notes[i]);
  return buf;
}
