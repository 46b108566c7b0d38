"""The stacks `tandem bench serve --launch` starts: which, in which order, and each
one's ``tandem up`` configuration."""

from __future__ import annotations

import argparse
from typing import Any

from tandem.bench import kvstore_disk


def launch_plan(modes: list[str], speculative_config: str | None
                ) -> list[tuple[str, str | None, str]]:
    """The stacks ``--launch`` starts, in order: ``(mode, speculative config or None,
    label)``; each mode once, or without and then with speculation (label ``MODE+spec``)."""
    plan: list[tuple[str, str | None, str]] = []
    for mode in modes:
        plan.append((mode, None, mode))
        if speculative_config is not None:
            plan.append((mode, speculative_config, f"{mode}+spec"))
    return plan


def stack_plan(args: argparse.Namespace) -> list[tuple[str, Any, str, str, str, str]]:
    """Every stack ``--launch`` runs, in order: ``(mode, speculative config, label,
    tracing, store tier, kv events)``; a dimension given more than once names its value
    in the label."""
    tracing_modes = args.launch_tracing or ["off"]
    tiers = args.launch_kvstore_tiers or ["ram"]
    kv_events = args.launch_kv_events or ["on"]
    plan = []
    for tracing in tracing_modes:
        for tier in tiers:
            for events in kv_events:
                for mode, spec, label in launch_plan(args.launch, args.speculative_config):
                    if len(tracing_modes) > 1:
                        label = f"{label}+tracing-{tracing}"
                    if len(tiers) > 1:
                        label = f"{label}+{tier}"
                    if len(kv_events) > 1:
                        label = f"{label}+kv-events-{events}"
                    plan.append((mode, spec, label, tracing, tier, events))
    return plan


def stack_config(args: argparse.Namespace, mode: str, spec: Any, tier: str, events: str,
                  run: int) -> Any:
    """The ``tandem up`` configuration of one launched stack."""
    from tandem.up import StackConfig

    colocated = mode == "colocated"
    engine_args = list(args.launch_engine_arg)
    if mode == "disagg-no-reuse":
        engine_args += ["--kv-load-from-store=false", "--kv-publish-output=false"]
    if events == "off":
        engine_args.append("--no-kv-events")  # after tandem up's --kv-events: wins
    return StackConfig(port=0, grpc_port=0, model=args.launch_model, colocated=colocated,
                       num_prefill=args.launch_prefill, num_decode=args.launch_decode,
                       engine_args=engine_args, router_args=list(args.launch_router_arg),
                       cpus_per_engine=0 if colocated else args.launch_disagg_cpus,
                       speculative_config=spec, engine_metrics=spec is not None,
                       **kvstore_disk.stack_fields(args, tier, run))
