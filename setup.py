"""Build of flashattn_ext: one extension, flashattn_ext._C.

Environment:
  FLASHATTN_FORCE_CUDA=1   build the CUDA kernels, fail if no CUDA toolkit is found or
                           torch is a CPU-only build
  FLASHATTN_SKIP_CUDA=1    CPU-only build even where a toolkit exists
  FLASHATTN_CUDA_ARCHS     compute capabilities (default "80;90a+PTX"): "90a" is Hopper's
                           own target, which the wgmma/TMA kernels need; "+PTX" on the
                           last one embeds PTX for newer GPUs
  FLASHATTN_HEAD_DIMS      comma list of head-dim tile widths to compile (default: all)
  CUDA_HOME / CUDA_PATH    the toolkit root (else the standard install root is searched)
  MAX_JOBS                 parallel compile jobs (ninja)

Whether CUDA is built is decided from the toolkit and from torch.version.cuda
(a CPU-only torch cannot build CUDA code), never from torch.cuda.is_available():
a build box usually has no GPU.
"""

import glob
import os
import re
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")
GENERATED = os.path.join(ROOT, "build", "generated")
VERSION = "0.1.0"


def is_cuda_toolkit(root):
    return all(
        os.path.exists(os.path.join(root, p))
        for p in ("bin/nvcc", "include/cuda_runtime.h", "lib64/libcudart.so")
    )


def find_cuda_home():
    """The toolkit root. torch guesses it from `nvcc` on PATH, which on some
    machines is a wrapper script outside the toolkit, so resolve it here."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            if not is_cuda_toolkit(root):
                sys.exit(f"flashattn_ext: {var}={root} is not a CUDA toolkit "
                         "(needs bin/nvcc, include/cuda_runtime.h, lib64/libcudart.so)")
            return root
    candidates = ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    candidates += ["/opt/cuda", "/usr/lib/cuda"]
    return next((c for c in candidates if is_cuda_toolkit(c)), None)


def env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def cuda_toolkit_for_build(skip_cuda, force_cuda, toolkit, torch_version, torch_cuda):
    """The CUDA toolkit to build the kernels with, or None and why not: (toolkit, None)
    or (None, reason). Exits where the settings cannot be met.

    toolkit: the one found, None if none (or not looked for: FLASHATTN_SKIP_CUDA).
    torch_cuda: torch.version.cuda, None for a CPU-only torch, whose cpp_extension
    cannot compile CUDA code whatever toolkit is installed."""
    if skip_cuda and force_cuda:
        sys.exit("flashattn_ext: FLASHATTN_SKIP_CUDA and FLASHATTN_FORCE_CUDA are both set; unset one")
    if skip_cuda:
        return None, "FLASHATTN_SKIP_CUDA is set"
    if toolkit is None:
        if force_cuda:
            sys.exit("flashattn_ext: FLASHATTN_FORCE_CUDA=1 but no CUDA toolkit was found; set CUDA_HOME")
        return None, "no CUDA toolkit was found (set CUDA_HOME to use one)"
    if torch_cuda is None:
        if force_cuda:
            sys.exit(f"flashattn_ext: FLASHATTN_FORCE_CUDA=1 but torch {torch_version} is a CPU-only "
                     "build (torch.version.cuda is None), which cannot compile CUDA extensions: "
                     "install a CUDA build of torch (PyPI's Linux wheels are; +cpu wheels are not), "
                     "or unset FLASHATTN_FORCE_CUDA for a CPU-only build")
        return None, (f"torch {torch_version} is a CPU-only build, so the CUDA toolkit at {toolkit} "
                      "is not used (a CUDA build of torch builds the CUDA kernels too; "
                      "FLASHATTN_FORCE_CUDA=1 makes this an error)")
    return toolkit, None


def read_sources():
    groups = {}
    with open(os.path.join(CSRC, "SOURCES.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].split()
            if line:
                groups.setdefault(line[0], []).extend(line[1:])
    return groups


def selected_tiles(all_tiles):
    """The widths to compile, smallest first (the order dispatch tries them in)."""
    wanted = os.environ.get("FLASHATTN_HEAD_DIMS", "").strip()
    if not wanted:
        return sorted(all_tiles, key=int)
    tiles = sorted({int(w) for w in re.split(r"[,; ]+", wanted) if w})
    unknown = [t for t in tiles if str(t) not in all_tiles]
    if unknown:
        sys.exit(f"flashattn_ext: FLASHATTN_HEAD_DIMS has {unknown}, not among the tile widths {all_tiles}")
    return [str(t) for t in tiles]


def write_tile_sources(templates, tiles, score_mods, out_dir):
    """The kernels' translation units: each template (a cuda_tile path of
    SOURCES.txt) once per tile width, with @HEAD_DIM_TILE@ replaced by the width,
    written under out_dir with the width appended to the name
    (cuda/instantiations/fwd_hdim.cu.in -> cuda/instantiations/fwd_hdim64.cu), and a
    template with @SCORE_MOD@ once more per score-mod variant (SOURCES.txt's
    score_mods), the variant appended too (fwd_hdim64_kBias.cu).
    CMakeLists.txt writes the same files with configure_file. Returns their paths."""
    paths = []
    for template in templates:
        with open(os.path.join(CSRC, template)) as f:
            text = f.read()
        variants = score_mods if "@SCORE_MOD@" in text else [None]
        for width in tiles:
            for mod in variants:
                suffix = width if mod is None else f"{width}_{mod}"
                path = os.path.join(out_dir, template[:-len(".cu.in")] + suffix + ".cu")
                unit = text.replace("@HEAD_DIM_TILE@", width)
                write_if_changed(path, unit if mod is None else unit.replace("@SCORE_MOD@", mod))
                paths.append(path)
    return paths


def gencode_flags(archs):
    """nvcc flags for an arch list such as "80;90a+PTX": machine code for each
    entry; "+PTX" adds PTX of that compute capability for newer GPUs (of the
    portable target: "90a+PTX" embeds compute_90, since sm_90a PTX runs on 9.0 only).
    Returns the flags, the list as recorded, and whether sm_90a code is built
    (the Hopper kernels: wgmma, TMA, setmaxnreg)."""
    flags = []
    entries = [a.strip() for a in re.split(r"[;, ]+", archs) if a.strip()]
    for entry in entries:
        ptx = entry.endswith("+PTX")
        cc = entry.replace("+PTX", "").replace(".", "")
        if not re.fullmatch(r"\d+a?", cc):
            sys.exit(f"flashattn_ext: FLASHATTN_CUDA_ARCHS entry {entry!r} is not like 80, 90a or 90a+PTX")
        flags.append(f"-gencode=arch=compute_{cc},code=sm_{cc}")
        if ptx:
            portable = cc.rstrip("a")
            flags.append(f"-gencode=arch=compute_{portable},code=compute_{portable}")
    with_sm90a = any(e.replace("+PTX", "") == "90a" for e in entries)
    return flags, ";".join(entries), with_sm90a


def write_if_changed(path, text):
    """Writes path unless it already holds text: ninja rebuilds by modification time."""
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def write_build_config(defines):
    """The build's choices as a header (GENERATED/flashattn_build_config.h) that
    every source includes, rather than -D flags that host compiler and nvcc quote
    differently; CMakeLists.txt writes the same header."""
    lines = ["// Generated by setup.py: the choices of this build.", "#pragma once"]
    lines += [f"#define {k}" if v is None else f"#define {k} {v}" for k, v in defines]
    write_if_changed(os.path.join(GENERATED, "flashattn_build_config.h"), "\n".join(lines) + "\n")


def libstdcxx_link_args():
    """Link the extension against the libstdc++.so that torch runs with.

    Some toolchains link libstdc++ statically into shared objects (seen: a g++ in
    /opt/gcc named by CXX, which torch.utils.cpp_extension uses). A static copy
    beside the process's shared one crashes the first time a C++ error message is
    formatted (half of the stream and locale state binds to each copy). Naming
    the loaded libstdc++.so.6 first resolves every libstdc++ symbol to it; any
    archive member still pulled in for a symbol it lacks is kept private
    (--exclude-libs), so the two copies never share state."""
    if not sys.platform.startswith("linux"):
        return []
    import torch  # noqa: F401  (loads the libstdc++ torch runs with)

    try:
        with open("/proc/self/maps") as maps:
            loaded = {line.split()[-1] for line in maps if "/libstdc++.so" in line}
    except OSError:
        loaded = set()
    return sorted(loaded)[:1] + ["-Wl,--exclude-libs,libstdc++.a"]


def torch_parallel_backend():
    import torch

    return torch.__config__.parallel_info()


def extensions():
    """The extension and the build_ext command that builds it."""
    import torch

    groups = read_sources()
    skip_cuda = env_flag("FLASHATTN_SKIP_CUDA")
    cuda_home, cpu_only_reason = cuda_toolkit_for_build(
        skip_cuda, env_flag("FLASHATTN_FORCE_CUDA"), None if skip_cuda else find_cuda_home(),
        torch.__version__, torch.version.cuda)
    with_cuda = cuda_home is not None
    if with_cuda:
        # Must precede the import: torch.utils.cpp_extension reads it once.
        os.environ["CUDA_HOME"] = cuda_home

    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    sources = groups["common"] + groups["python"]
    defines = [("FLASHATTN_BUILD_VERSION", f'"{VERSION}"')]
    # ATen's at::parallel_for is a header template: with torch's OpenMP backend
    # (the Linux wheels) the CPU kernels run in parallel only when compiled with it.
    openmp = ["-fopenmp"] if "OpenMP" in torch_parallel_backend() else []
    cxx_flags = ["-O3"] + openmp
    tiles = []
    nvcc_flags = []
    if with_cuda:
        tiles = selected_tiles(groups["tiles"])
        sources += groups["cuda"]
        gencode, arch_list, with_sm90a = gencode_flags(os.environ.get("FLASHATTN_CUDA_ARCHS", "80;90a+PTX"))
        cuda_version = re.search(r"release (\S+),", os.popen(f"{cuda_home}/bin/nvcc --version").read())
        defines += [
            ("FLASHATTN_WITH_CUDA", None),
            ("FLASHATTN_BUILD_CUDA_VERSION", f'"{cuda_version.group(1) if cuda_version else "unknown"}"'),
            ("FLASHATTN_BUILD_CUDA_ARCHS", f'"{arch_list}"'),
            ("FLASHATTN_BUILD_HEAD_DIM_TILES", f'"{" ".join(tiles)}"'),
            ("FLASHATTN_FOR_EACH_TILE(X)", " ".join(f"X({w})" for w in tiles)),
        ]
        if with_sm90a:
            defines.append(("FLASHATTN_BUILD_SM90A", None))
        nvcc_flags = ["-O3", "-lineinfo", "--expt-relaxed-constexpr", "-Xptxas=-warn-spills"] + gencode
        message = (f"flashattn_ext: building CUDA kernels with {cuda_home} for {arch_list}, "
                   f"head-dim tiles {' '.join(tiles)}")
    else:
        message = f"flashattn_ext: building the CPU kernels only: {cpu_only_reason}"

    class BuildExt(BuildExtension):
        def run(self):
            # Said and written here rather than when setup.py runs: pip runs setup.py
            # once for the metadata and once more for the build.
            print(message, flush=True)
            write_build_config(defines)
            # Added here, not to the Extension's sources: the sdist must not list
            # generated files.
            tile_sources = write_tile_sources(groups["cuda_tile"], tiles, groups["score_mods"], GENERATED)
            ext.sources += [os.path.relpath(p, ROOT) for p in tile_sources]
            super().run()

    ext_cls = CUDAExtension if with_cuda else CppExtension
    ext = ext_cls(
        name="flashattn_ext._C",
        sources=[os.path.join("csrc", s) for s in sources],
        include_dirs=[CSRC, GENERATED],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags} if with_cuda else {"cxx": cxx_flags},
        extra_link_args=openmp + libstdcxx_link_args(),
    )
    return ext, BuildExt


# Guarded so that tests can import this file for cuda_toolkit_for_build; setuptools
# runs it as __main__.
if __name__ == "__main__":
    extension, build_ext = extensions()
    setup(
        name="flashattn_ext",
        version=VERSION,
        packages=find_packages(include=["flashattn_ext", "flashattn_ext.*"]),
        ext_modules=[extension],
        cmdclass={"build_ext": build_ext},
    )
