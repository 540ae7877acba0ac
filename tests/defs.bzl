"""twin_test: a Criterion test with the project's main (per-case XML for Bazel).

twin_test(name, srcs, deps, data, gpu = False): gpu tests get tags = ["gpu"] (left out of
the default run; `bazel test --config=gpu` runs them) and link the gpu backend.
"""

def twin_test(name, srcs, deps = [], data = [], gpu = False, tags = [], size = "medium", **kwargs):
    native.cc_test(
        name = name,
        srcs = srcs + ["//tests:criterion_main.c"],
        deps = deps + [
            "//core",
            "//ref",
            "//tests:test_util",
            "//golden:runner",
            "//shard:golden",
            "@criterion",
        ] + (["//gpu"] if gpu else []),
        data = data,
        tags = tags + (["gpu", "exclusive"] if gpu else []),
        size = size,
        **kwargs
    )
