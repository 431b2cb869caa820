"""Every SGLang name the plugin hooks: where each release keeps it, and what replaces or wraps it.

This table is the one place that knows SGLang's layout. A row lists the
homes of a name, newest first (the first the installed release has is the
one hooked), and the candidate hooks, newest release family first (the first
whose needs the release meets is registered; ``plan.py`` decides).

Adding a release: record it with ``tools/sglang_releases.py``, run the
release tests, and where a method changed shape, add a hook for the new
family in ``pools.py`` (declaring its needs) at the front of its row.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import ops, pools

# Homes, newest first.
HICACHE = ("sglang.kernels.ops.kvcache.hicache",  # 0.5.17+
           "sglang.jit_kernel.hicache")  # up to 0.5.16
KVCACHEIO = ("sgl_kernel.kvcacheio",)
_POOLS, _LEGACY = "sglang.srt.mem_cache.pool_host", "sglang.srt.mem_cache.memory_pool_host"
MLA = (f"{_POOLS}.mla.MLATokenToKVPoolHost", f"{_LEGACY}.MLATokenToKVPoolHost")  # pool_host/ from 0.5.16
MHA = (f"{_POOLS}.mha.MHATokenToKVPoolHost", f"{_LEGACY}.MHATokenToKVPoolHost")
DSA = (f"{_POOLS}.dsa.DSAIndexerPoolHost", f"{_LEGACY}.DSAIndexerPoolHost")  # pool_host/dsa.py from 0.5.19
BASE = (f"{_POOLS}.base.HostKVCache",)


@dataclass(frozen=True)
class Target:
    name: str  # how logs, status and the support table name it
    paths: tuple  # dotted upstream names, newest home first
    kind: str  # "REPLACE", "AROUND" or "AFTER" (SGLang's HookType names)
    hooks: tuple  # candidates, newest release family first


def _at(homes, attr: str) -> tuple:
    return tuple(f"{home}.{attr}" for home in homes)


TARGETS = (
    *(Target(f"hicache.{name}", _at(HICACHE, name), "REPLACE", (getattr(ops, name),)) for name in ops.HICACHE_OPS),
    *(Target(f"kvcacheio.{name}", _at(KVCACHEIO, name), "REPLACE", (getattr(ops, name),))
      for name in ops.KVCACHEIO_OPS),
    Target("MLA.load_to_device_per_layer", _at(MLA, "load_to_device_per_layer"), "AROUND",
           (pools.load_to_device_per_layer,)),
    Target("MLA.backup_from_device_all_layer", _at(MLA, "backup_from_device_all_layer"), "AROUND",
           (pools.backup_from_device_all_layer,)),
    Target("MLA._backup_from_device_per_layer", _at(MLA, "_backup_from_device_per_layer"), "AROUND",
           (pools.mla_backup_from_device_per_layer, pools.mla_backup_from_device_per_layer_0522,
            pools.mla_backup_from_device_per_layer_0516)),
    Target("MHA.load_to_device_per_layer", _at(MHA, "load_to_device_per_layer"), "AROUND",
           (pools.load_to_device_per_layer,)),
    Target("MHA.backup_from_device_all_layer", _at(MHA, "backup_from_device_all_layer"), "AROUND",
           (pools.backup_from_device_all_layer,)),
    Target("DSA.load_to_device_per_layer", _at(DSA, "load_to_device_per_layer"), "AROUND",
           (pools.load_to_device_per_layer,)),
    Target("DSA.backup_from_device_all_layer", _at(DSA, "backup_from_device_all_layer"), "AROUND",
           (pools.backup_from_device_all_layer,)),
    Target("DSA._backup_from_device_per_layer", _at(DSA, "_backup_from_device_per_layer"), "AROUND",
           (pools.dsa_backup_from_device_per_layer, pools.dsa_backup_from_device_per_layer_0516)),
    Target("HostKVCache._require_packed_device_rows", _at(BASE, "_require_packed_device_rows"), "AROUND",
           (pools.require_packed_device_rows,)),
    # One log line per pool naming its path, after the pool set up its transfer views.
    Target("MLA.describe", _at(MLA, "_initialize_transfer_views") + _at(MLA, "_init_write_back_staging_buffers"),
           "AFTER", (pools.describe_pool,)),
    Target("MHA.describe", _at(MHA, "_initialize_transfer_views") + _at(MHA, "_init_write_back_staging_buffers"),
           "AFTER", (pools.describe_pool,)),
    Target("DSA.describe", _at(DSA, "_init_write_back_staging_buffers"), "AFTER", (pools.describe_pool,)),
)
