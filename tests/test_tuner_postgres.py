"""Two tuner processes share one study through a real PostgreSQL server."""
import os
import subprocess
import sys
from pathlib import Path

import optuna
from services import postgres_url  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parent.parent


def test_two_processes_tune_one_study(postgres_url, tmp_path):  # noqa: F811
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    cmd = [sys.executable, "-m", "tuner_toys", postgres_url, "shared", "12", str(tmp_path / "results")]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    study = optuna.load_study(study_name="shared", storage=postgres_url)
    trials = study.get_trials(deepcopy=False)
    finished = [t for t in trials if t.state.is_finished()]
    assert 12 <= len(finished) <= 14  # each stops once the study holds 12
    assert len({t.number for t in trials}) == len(trials)
    workers = {t.user_attrs.get("worker") for t in finished}
    assert len(workers) == 2, workers  # both processes contributed trials
    assert sum(t.user_attrs.get("seed") == "defaults" for t in trials) <= 2
    assert study.best_trial.user_attrs["knobs"]["method"] != "broken"
