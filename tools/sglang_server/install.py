"""Installs a server carry (``carry.py``) into a fresh site directory on the GPU machine, refusing what it
cannot vouch for. ``tools/gpu_server.sh`` runs it; any refusal stops that script.

    python3 tools/sglang_server/install.py CARRY SITE ENV_FILE FACTS_FILE

* every file of ``CARRY`` but ``carry.json`` must be listed in ``carry.json``'s ``sha256`` with that digest,
  and every listed file must be there (a stray wheel would otherwise be installed too);
* ``SITE`` must not exist, or be an empty directory: a carry is never installed over another's files (0.5.19
  over 0.5.23 failed every server import with ``PrefillCPBCGInput``, the two releases' files mixed);
* each ``*.tar.gz`` is extracted member by member: regular files and directories only (no links, devices or
  FIFOs), no absolute name and no ``..`` component, modes 0644/0755;
* the wheels go in with ``pip install --no-index --no-deps --target SITE`` (pip refuses a wheel member that
  leaves the target);
* ``carry.json``'s ``env`` is data: each name must match ``SGLANG_[A-Z0-9_]+`` and each value be one line
  of text; they are written to ``ENV_FILE`` as NUL-terminated ``NAME=value`` items, which the script exports
  one by one (``export "$item"``: the value is never parsed by the shell);
* ``FACTS_FILE`` gets two lines: the release and the route's label.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

ENV_NAME = re.compile(r"^SGLANG_[A-Z0-9_]{1,100}$")
MAX_VALUE = 4096


class Refused(Exception):
    """What the carry holds cannot be installed; the message says which file and why."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_facts(carry: Path) -> dict:
    try:
        facts = json.loads((carry / "carry.json").read_text())
    except (OSError, ValueError) as exc:
        raise Refused(f"{carry / 'carry.json'}: cannot be read as JSON ({exc})") from None
    if not isinstance(facts, dict) or not isinstance(facts.get("sha256"), dict) or not facts["sha256"]:
        raise Refused(f"{carry / 'carry.json'} lists no sha256 of its files: build the carry again with "
                      "tools/sglang_carry.py --server")
    for key in ("release", "label"):
        if not isinstance(facts.get(key), str) or "\n" in facts[key] or not facts[key]:
            raise Refused(f"{carry / 'carry.json'}: {key} must be one line of text")
    return facts


def check_files(carry: Path, facts: dict) -> list:
    """The carry's files, each checked against its recorded sha256; Refused for a missing, extra or changed one."""
    listed = facts["sha256"]
    present = sorted(p.name for p in carry.iterdir() if p.name != "carry.json")
    extra = sorted(set(present) - set(listed))
    missing = sorted(set(listed) - set(present))
    if extra or missing:
        raise Refused(f"{carry}: files not in carry.json: {extra}; listed but missing: {missing}")
    for name in present:
        path = carry / name
        if "/" in name or not stat.S_ISREG(os.lstat(path).st_mode):
            raise Refused(f"{path}: not a regular file")
        if _sha256(path) != listed[name]:
            raise Refused(f"{path}: sha256 differs from carry.json's {listed[name]}")
    return [carry / name for name in present]


def unsafe(member: tarfile.TarInfo) -> str | None:
    name = member.name
    if not (member.isfile() or member.isdir()):
        return "not a regular file or directory"
    if not name or name.startswith("/") or "\\" in name or "\0" in name:
        return "an absolute or unusual name"
    if ".." in name.split("/"):
        return "a '..' component"
    return None


def extract(archive: Path, site: Path) -> int:
    """Extracts ``archive`` into ``site`` after checking every member; returns the number of files."""
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        for member in members:
            why = unsafe(member)
            if why is not None:
                raise Refused(f"{archive}: member {member.name!r} is {why}; nothing of it is extracted")
        files = 0
        for member in members:
            target = site / member.name
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            with open(target, "xb") as f:  # "x": a name twice in the archive is refused, never overwritten
                f.write(source.read())
            os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)
            files += 1
    return files


def env_items(facts: dict) -> list:
    env = facts.get("env", {})
    if not isinstance(env, dict):
        raise Refused("carry.json: env must be an object of names and values")
    items = []
    for name, value in sorted(env.items()):
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise Refused(f"carry.json: env name {name!r} is not of the form SGLANG_[A-Z0-9_]+")
        if not isinstance(value, str) or len(value) > MAX_VALUE or any(c in value for c in "\0\n\r"):
            raise Refused(f"carry.json: env {name} must be one line of text (at most {MAX_VALUE} characters)")
        items.append(f"{name}={value}")
    return items


def fresh(site: Path) -> None:
    if site.is_symlink() or (site.exists() and (not site.is_dir() or any(site.iterdir()))):
        raise Refused(f"{site}: not a fresh directory; a carry is installed into an empty one of its own")
    site.mkdir(parents=True, exist_ok=True)


def install(carry: Path, site: Path, env_file: Path, facts_file: Path) -> dict:
    facts = read_facts(carry)
    items = env_items(facts)
    files = check_files(carry, facts)
    fresh(site)
    for archive in (f for f in files if f.name.endswith(".tar.gz")):
        extract(archive, site)
    wheels = [str(f) for f in files if f.name.endswith(".whl")]
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--target", str(site), *wheels], check=True)
    env_file.write_bytes(b"".join(item.encode() + b"\0" for item in items))
    facts_file.write_text(f"{facts['release']}\n{facts['label']}\n")
    return facts


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    carry, site, env_file, facts_file = map(Path, args)
    try:
        facts = install(carry, site, env_file, facts_file)
    except Refused as exc:
        print(f"carry refused: {exc}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as exc:
        print(f"carry refused: pip could not install its wheels (exit {exc.returncode})", file=sys.stderr)
        return 1
    print(f"installed sglang {facts['release']} ({facts['label']}) into {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
