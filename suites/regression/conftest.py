"""The regression suite's pytest plumbing: its shape option and the machine's fingerprint in every save."""
from __future__ import annotations


def pytest_addoption(parser):
    parser.addoption("--regression-shapes", choices=("small", "tiny"), default="small",
                     help="kernel regression cases on the small preset's shapes (default) or on toy shapes")


def pytest_benchmark_update_machine_info(config, machine_info):
    from engine.fingerprint import describe, fingerprint

    fp = fingerprint()
    machine_info["moetune"] = {"fingerprint": fp, "describe": describe(fp)}
