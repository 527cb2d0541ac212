"""Which arms an A/B run trains: per optimizer, the reference, the candidate and the null arms."""
from __future__ import annotations

from pathlib import Path

from ..train.arm import ArmSpec
from .runner import Job


def plan_arms(recipe, slot: str, candidate: str, optimizers, out: Path, lockstep: bool) -> list:
    """Reference arms first: they are what everything else is compared with. The lockstep check rides in the
    candidate's own arm, so the reference and null arms run no candidate code (ab/share.py shares and caches them)."""
    base = dict(recipe.kernels)
    jobs = [Job(f"{opt}/reference", out / opt / "reference", ArmSpec("reference", opt, {**base, slot: "reference"}))
            for opt in optimizers]
    for opt in optimizers:
        jobs.append(Job(f"{opt}/candidate", out / opt / "candidate",
                        ArmSpec("candidate", opt, {**base, slot: candidate}, lockstep=slot if lockstep else None)))
        for k in range(1, recipe.ab.nulls + 1):
            jobs.append(Job(f"{opt}/null-{k}", out / opt / f"null-{k}", ArmSpec(f"null-{k}", opt, {**base, slot: f"null-{k}"})))
    return jobs
