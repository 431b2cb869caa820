"""``grid``, ``beside`` and ``overhead``: the CLI's ``sglang-hicache-jit bench`` (transfer, interference and
overhead modes, sglang_hicache_jit/bench/), with its options, writing its records as result rows too."""

from __future__ import annotations

MODES = {"grid": "transfer", "beside": "interference", "overhead": "overhead"}


def add_arguments(p, name: str) -> None:
    from sglang_hicache_jit.bench import command

    command.add_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true", help="print no row per measurement")
    p.set_defaults(mode=MODES[name])


class _Rows(list):
    """The records list a mode appends to as it measures: each record also becomes a result row at once."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def append(self, record: dict) -> None:
        super().append(record)
        self.out.row(**record)


def run(args, out, name: str) -> int:
    from sglang_hicache_jit.bench import command

    args.mode = MODES[name]
    return command.run_parsed(args, records=_Rows(out))
