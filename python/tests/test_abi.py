"""The ctypes mirror matches include/flashattn.h: every field offset, struct size and
enum value, as a C compiler sees them; and the library's version matches the package's."""
import ctypes
import os
import re
import shutil
import subprocess
import sys

import pytest

import flashattn
from flashattn import _lib

HEADER_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "include")
ENUMS = {
    "FA_OK": _lib.Status.OK, "FA_ERR_INVALID_ARGUMENT": _lib.Status.ERR_INVALID_ARGUMENT,
    "FA_ERR_UNSUPPORTED": _lib.Status.ERR_UNSUPPORTED,
    "FA_ERR_OUT_OF_MEMORY": _lib.Status.ERR_OUT_OF_MEMORY,
    "FA_ERR_DEVICE": _lib.Status.ERR_DEVICE, "FA_ERR_INTERNAL": _lib.Status.ERR_INTERNAL,
    "FA_DTYPE_F32": _lib.DType.F32, "FA_DTYPE_F16": _lib.DType.F16,
    "FA_DTYPE_BF16": _lib.DType.BF16, "FA_DTYPE_F64": _lib.DType.F64,
    "FA_DEVICE_CPU": _lib.Device.CPU, "FA_DEVICE_CUDA": _lib.Device.CUDA,
    "FA_ALGO_FLASH2": _lib.Algorithm.FLASH2, "FA_ALGO_FLASH1": _lib.Algorithm.FLASH1,
    "FA_ALGO_STANDARD": _lib.Algorithm.STANDARD,
    "FA_PASS_FORWARD": _lib.Pass.FORWARD, "FA_PASS_BACKWARD": _lib.Pass.BACKWARD,
    "FA_MAX_HEADDIM": _lib.MAX_HEADDIM,
}
STRUCTS = {"fa_tensor": _lib.FaTensor, "fa_params": _lib.FaParams, "fa_kvcache": _lib.FaKvcache}


def _c_layout(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None or not os.path.exists(os.path.join(HEADER_DIR, "flashattn.h")):
        pytest.skip("needs a C compiler and the repository's include/flashattn.h")
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <flashattn.h>",
             "int main(void) {"]
    for cname, st in STRUCTS.items():
        lines.append('printf("%s sizeof %%zu\\n", sizeof(%s));' % (cname, cname))
        lines.append('printf("%s alignof %%zu\\n", _Alignof(%s));' % (cname, cname))
        for f, _ in st._fields_:
            lines.append('printf("%s %s %%zu %%zu\\n", offsetof(%s, %s), sizeof(((%s *)0)->%s));'
                         % (cname, f, cname, f, cname, f))
    for name in ENUMS:
        lines.append('printf("enum %s %%lld\\n", (long long)(%s));' % (name, name))
    lines.append("return 0; }")
    src = tmp_path / "abi.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "abi"
    subprocess.run([cc, "-std=c11", "-I", HEADER_DIR, str(src), "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


def test_struct_layout_and_enums_match_header(tmp_path):
    out = _c_layout(tmp_path).splitlines()
    seen = 0
    for line in out:
        parts = line.split()
        if parts[0] in STRUCTS:
            st = STRUCTS[parts[0]]
            if parts[1] == "sizeof":
                assert ctypes.sizeof(st) == int(parts[2]), line
            elif parts[1] == "alignof":
                assert ctypes.alignment(st) == int(parts[2]), line
            else:
                field = getattr(st, parts[1])
                assert field.offset == int(parts[2]), line
                assert field.size == int(parts[3]), line
            seen += 1
        elif parts[0] == "enum":
            assert int(ENUMS[parts[1]]) == int(parts[2]), line
            seen += 1
    assert seen == sum(len(s._fields_) + 2 for s in STRUCTS.values()) + len(ENUMS)


def test_every_header_field_is_mirrored():
    """A field added to the header but not to the ctypes mirror fails here."""
    path = os.path.join(HEADER_DIR, "flashattn.h")
    if not os.path.exists(path):
        pytest.skip("needs the repository's include/flashattn.h")
    text = open(path).read()
    for cname, st in STRUCTS.items():
        body = text.split("typedef struct %s {" % cname)[1].split("} %s;" % cname)[0]
        body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
        names = []
        for decl in body.split(";"):
            if not decl.strip():
                continue
            for part in decl.replace("*", " ").split(","):
                names.append(part.split()[-1])
        assert names == [f for f, _ in st._fields_], cname


def test_version():
    assert flashattn.version() == flashattn.__version__
    assert flashattn.device_available("cpu")
    assert isinstance(flashattn.cuda_available(), bool)


def test_operators_share_the_cpp_runtime():
    """flashattn._C uses the libstdc++ torch runs with. A copy of its own (a toolchain that
    links libstdc++ statically) binds partly to the process's copy and crashed formatting
    error messages when the two differed in version."""
    from flashattn import _ops
    if _ops._C is None or not sys.platform.startswith("linux"):
        pytest.skip("needs the compiled operators (flashattn._C) on Linux")
    name = "_ZNSo9_M_insertIlEERSoT_"  # std::ostream::_M_insert<long>, formats an int64
    try:
        addr = ctypes.cast(getattr(ctypes.CDLL(_ops._C.__file__), name), ctypes.c_void_p).value
    except AttributeError:
        pytest.skip("no libstdc++ among the module's libraries (another C++ runtime)")

    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

    info = DlInfo()
    assert ctypes.CDLL(None).dladdr(ctypes.c_void_p(addr), ctypes.byref(info))
    where = os.path.basename(info.fname.decode())
    assert where.startswith("libstdc++"), (
        "%s defines its own %s (from %s): it carries a static libstdc++; link the shared one"
        % (_ops._C.__file__, name, where))
