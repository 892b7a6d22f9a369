"""Autoscaling on a simulated three-node Ray cluster (see `autoscaling_scenario`): under load the
replica count grows onto new nodes, it shrinks back after, and every request succeeds."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.serving.autoscaling_scenario import NODES

pytestmark = [pytest.mark.ray, pytest.mark.own_ray]

MARKER = "AUTOSCALING_OUTCOME "


def test_replicas_grow_onto_new_nodes_and_shrink_back(tiny_model_dir: pathlib.Path) -> None:
    root = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "tests.serving.autoscaling_scenario", str(tiny_model_dir)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith(MARKER)]
    outcome = json.loads(line.removeprefix(MARKER))
    assert outcome["failed"] == [], outcome
    assert outcome["peak_replicas"] == NODES, outcome
    assert outcome["slots_free_at_peak"] == 0.0, outcome  # one replica on each node
    assert outcome["replicas_that_served"] == NODES, outcome  # each new one took requests
    assert outcome["final_replicas"] == 1, outcome
    assert outcome["succeeded"] > 0
