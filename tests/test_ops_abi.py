"""The ctypes mirror of HicacheTransfer (transfer/abi.py's _CTransfer) matches the C header field for field."""

import shutil
import subprocess
from pathlib import Path

import pytest

from sglang_hicache_jit.transfer import abi

HEADER = Path(__file__).resolve().parent.parent / "kernels" / "hicache_transfer.h"
# C name of each ctypes field (the two-element arrays are two ctypes fields).
C_NAMES = {"src_table0": "src_tables[0]", "src_table1": "src_tables[1]", "dst_table0": "dst_tables[0]",
           "dst_table1": "dst_tables[1]", "src_base0": "src_bases[0]", "src_base1": "src_bases[1]",
           "dst_base0": "dst_bases[0]", "dst_base1": "dst_bases[1]", "src_live0": "src_live[0]",
           "src_live1": "src_live[1]", "dst_live0": "dst_live[0]", "dst_live1": "dst_live[1]"}


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_ctypes_struct_matches_header(tmp_path):
    fields = [name for name, _ in abi._CTransfer._fields_]
    lines = [f'printf("%zu\\n", offsetof(HicacheTransfer, {C_NAMES.get(f, f)}));' for f in fields]
    source = tmp_path / "abi.c"
    source.write_text(f'#include <stddef.h>\n#include <stdio.h>\n#include "{HEADER}"\nint main(void) {{\n'
                      + "\n".join(lines) + '\nprintf("%zu\\n", sizeof(HicacheTransfer));\nreturn 0;\n}\n')
    exe = tmp_path / "abi"
    subprocess.run(["cc", "-o", str(exe), str(source)], check=True)
    c_offsets = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True,
                                                text=True).stdout.split()]
    py_offsets = [getattr(abi._CTransfer, f).offset for f in fields] + [abi.ctypes.sizeof(abi._CTransfer)]
    assert py_offsets == c_offsets
