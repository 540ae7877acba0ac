"""cuda_library: nvcc compiles each .cu to an object (genrule), a cc_library links them.

There is no rules_cuda offline for Bazel 4.2.3; this is the project's own small rule.
Code is built for sm_80 and sm_90a (wgmma/TMA) with compute_80 PTX embedded so any later GPU
can JIT it.
"""

load("@cuda//:defs.bzl", "NVCC")

CUDA_ARCH_FLAGS = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_80,code=compute_80",
]

def cuda_library(name, srcs, hdrs = [], deps = [], nvcc_flags = [], **kwargs):
    """Compiles srcs (.cu) with nvcc; hdrs are the headers they include (package-relative or labels)."""
    objs = []
    for src in srcs:
        base = src.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        obj = "_cuda_objs/%s/%s.o" % (name, base)
        native.genrule(
            name = "%s_%s_nvcc" % (name, base),
            srcs = [src] + hdrs,
            outs = [obj],
            cmd = " ".join([
                NVCC,
                "-c",
                "-std=c++17",
                "-O3",
                "-lineinfo",
                "-Xcompiler -fPIC",
                "-I.",
                "-Iinclude",
                "-I$(GENDIR)",
                "--expt-relaxed-constexpr",
            ] + CUDA_ARCH_FLAGS + nvcc_flags + [
                "-o $@",
                "$(location %s)" % src,
            ]),
            tags = ["cuda"],
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = [h for h in hdrs if not h.startswith("//") and not h.startswith(":") and not h.startswith("@")],
        deps = deps + ["@cuda//:cudart"],
        alwayslink = 1,
        **kwargs
    )
