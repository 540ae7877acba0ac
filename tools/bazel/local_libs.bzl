"""System libraries as local repositories: OpenBLAS, Criterion (Debian), the CUDA toolkit.

The CUDA toolkit location defaults to /usr/local/cuda; set CUDA_PATH to override it.
"""

def _cuda_repo_impl(rctx):
    cuda = rctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    for d in ["include", "lib64", "bin", "nvvm"]:
        rctx.symlink(cuda + "/" + d, d)
    rctx.file("WORKSPACE", 'workspace(name = "cuda")\n')
    rctx.file("defs.bzl", 'CUDA_PATH = "%s"\nNVCC = "%s/bin/nvcc"\n' % (cuda, cuda))
    rctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

exports_files(["bin/nvcc", "defs.bzl"])

filegroup(name = "nvcc_files", srcs = glob(["bin/**"], allow_empty = True))

filegroup(name = "cuda_headers", srcs = glob(["include/**"], allow_empty = True))

cc_library(
    name = "cuda_headers_lib",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp"], allow_empty = True),
    includes = ["include"],
)

# Static cudart: executables run on a machine that has only the driver.
cc_library(
    name = "cudart",
    srcs = ["lib64/libcudart_static.a"],
    linkopts = ["-ldl", "-lpthread", "-lrt"],
    deps = [":cuda_headers_lib"],
)

cc_library(
    name = "cublaslt",
    linkopts = ["-L{cuda}/lib64", "-Wl,-rpath,{cuda}/lib64", "-lcublasLt"],
    deps = [":cuda_headers_lib"],
)

cc_library(
    name = "nccl",
    linkopts = ["-L{cuda}/lib64", "-Wl,-rpath,{cuda}/lib64", "-lnccl"],
    deps = [":cuda_headers_lib"],
)
""".format(cuda = cuda))

cuda_repository = repository_rule(
    implementation = _cuda_repo_impl,
    environ = ["CUDA_PATH"],
    local = True,
)

def twin_local_libs():
    # cblas.h is on the system include path (Debian's libopenblas-dev).
    native.new_local_repository(
        name = "openblas",
        path = "/usr/lib/x86_64-linux-gnu",
        build_file_content = """
package(default_visibility = ["//visibility:public"])
cc_library(
    name = "openblas",
    linkopts = ["-lopenblas"],
)
""",
    )
    native.new_local_repository(
        name = "criterion",
        path = "/usr/lib/x86_64-linux-gnu",
        build_file_content = """
package(default_visibility = ["//visibility:public"])
cc_library(
    name = "criterion",
    linkopts = ["-lcriterion"],
)
""",
    )
    cuda_repository(name = "cuda")
