"""`manage.py generate` (a clip from the command line), `train_demo_model` and `eval_demo_model`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import numpy as np
import pytest
import torch
from django.core.management import CommandError, call_command
from PIL import Image

from workers.runtime.engine import ChunkEngine
from workers.runtime.generate import read_mp4
from workers.runtime.models import build_model
from workers.runtime.models.demo_eval import measure_clip

ROOT = Path(__file__).resolve().parents[2]
FIRST = "a red circle moving right on a blue background"
SECOND = "a white square moving up on a green background"


def generate(*args: str) -> dict:
    out = StringIO()
    call_command("generate", *args, "--json", stdout=out)
    return json.loads(out.getvalue())


def png_frames(directory) -> list[bytes]:
    return [p.read_bytes() for p in sorted(directory.glob("frame_*.png"))]


def test_png_frames_follow_the_prompt_schedule_and_repeat_byte_for_byte(tmp_path):
    args = [
        "--preset",
        "demo",
        "--prompt",
        FIRST,
        "--prompt-at",
        f'3:"{SECOND}"',
        "--seed",
        "4",
        "--chunks",
        "5",
    ]
    summary = generate(*args, "--out", str(tmp_path / "a"))
    generate(*args, "--out", str(tmp_path / "b"))
    assert summary["frames"] == 20 and summary["prompts"] == {"0": FIRST, "3": SECOND}
    a, b = png_frames(tmp_path / "a"), png_frames(tmp_path / "b")
    assert len(a) == 20 and a == b
    frames = np.stack([np.asarray(Image.open(p)) for p in sorted((tmp_path / "a").glob("*.png"))])
    assert measure_clip(frames[:12])["colour"] == "red" and measure_clip(frames[12:])["colour"] == "white"
    # The same frames as a platform session with the prompt typed before chunk 3
    engine = ChunkEngine(build_model("demo"), encode_workers=1)
    try:
        engine.add_session("s", FIRST, seed=4)
        platform = []
        for chunk in range(5):
            if chunk == 3:
                engine.set_prompt("s", SECOND, from_chunk=3)
            platform.append(engine.step()[0].rgb)
    finally:
        engine.close()
    assert np.array_equal(torch.cat(platform).numpy(), frames)
    other_seed = generate("--prompt", FIRST, "--seed", "5", "--chunks", "5", "--out", str(tmp_path / "c"))
    assert other_seed["preset"] == "demo"  # the default preset
    assert png_frames(tmp_path / "c")[:4] != a[:4]


def test_mp4_through_pyav_decodes_to_the_clip(tmp_path):
    path = tmp_path / "clips" / "clip.mp4"  # the folder is created
    generate("--preset", "tiny", "--prompt", "waves", "--chunks", "3", "--out", str(path))
    assert read_mp4(path).shape == (12, 64, 64, 3)
    demo_args = ["--prompt", FIRST, "--chunks", "4", "--seed", "2"]
    generate(*demo_args, "--out", str(tmp_path / "demo.mp4"))
    generate(*demo_args, "--out", str(tmp_path / "png"))
    decoded = read_mp4(tmp_path / "demo.mp4")
    # H.264 is lossy: the decoded clip is close to the exact frames (the PNG output), not equal
    exact = np.stack([np.asarray(Image.open(p)) for p in sorted((tmp_path / "png").glob("*.png"))])
    assert decoded.shape == exact.shape == (16, 128, 128, 3)
    assert float(np.abs(decoded.astype(float) - exact.astype(float)).mean()) < 4.0
    assert measure_clip(decoded) == measure_clip(exact) == {
        "background": "blue", "colour": "red", "shape": "circle", "direction": "right", "speed": "slow"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--preset", "gigantic", "--prompt", "p", "--chunks", "1"], "--preset"),
        (["--prompt", "p", "--chunks", "0"], "--chunks"),
        (["--prompt", "p", "--chunks", "2", "--prompt-at", "two:x"], "--prompt-at"),
        (["--prompt", "p", "--chunks", "2", "--prompt-at", "1"], "--prompt-at"),
        (["--prompt", "p", "--chunks", "2", "--prompt-at", '1:""'], "--prompt-at"),
        (["--prompt", "p", "--chunks", "2", "--prompt-at", "5:x"], "--prompt-at"),
        (["--prompt", " ", "--chunks", "2"], "--prompt"),
    ],
)
def test_bad_input_names_the_flag(tmp_path, args, flag):
    with pytest.raises(CommandError) as excinfo:
        call_command("generate", *args, "--out", str(tmp_path / "out"), stdout=StringIO())
    assert str(excinfo.value).startswith(flag)
    assert not (tmp_path / "out").exists()  # nothing generated or created


def test_an_unwritable_out_names_the_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for out in (blocker / "frames", blocker / "clip.mp4"):
        with pytest.raises(CommandError, match=r"^--out"):
            call_command("generate", "--prompt", "p", "--chunks", "1", "--out", str(out), stdout=StringIO())
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(CommandError, match=r"^--out"):
            call_command(
                "generate", "--prompt", "p", "--chunks", "1", "--out", str(locked / "f"), stdout=StringIO()
            )


def test_train_smoke_writes_loadable_small_weights_deterministically(tmp_path):
    reports = []
    for name in ("a", "b"):
        out = StringIO()
        path = tmp_path / f"{name}.safetensors"
        call_command(
            "train_demo_model",
            "--seed",
            "1",
            "--steps",
            "3",
            "--batch",
            "4",
            "--out",
            str(path),
            "--json",
            stdout=out,
        )
        reports.append(json.loads(out.getvalue()))
    assert reports[0]["steps"] == 3 and reports[0]["final_loss"] == reports[1]["final_loss"]
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert (tmp_path / "a.safetensors").stat().st_size < 5 * 1024 * 1024
    model = build_model("demo", weights_path=str(tmp_path / "a.safetensors"))
    assert model.generate([model.create_state("a red circle moving left", 0)])[0].frames.shape == (
        4,
        128,
        128,
        3,
    )
    with pytest.raises(CommandError, match="--steps"):
        call_command("train_demo_model", "--steps", "0", "--out", str(tmp_path / "c.safetensors"))


def test_eval_command_prints_accuracy_json():
    out = StringIO()
    call_command("eval_demo_model", "--clips", "4", "--chunks", "2", "--no-realtime", "--json", stdout=out)
    report = json.loads(out.getvalue())
    assert report["clips"] == 4 and report["split"] == "held-out"
    assert set(report["accuracy"]) == {"shape", "colour", "background", "direction", "speed"}
    assert 0.0 <= report["overall"] <= 1.0
    with pytest.raises(CommandError, match="--clips"):
        call_command("eval_demo_model", "--clips", "0")


def test_a_deployment_serves_demo_by_default_and_new_sessions_get_it():
    # The suite serves `tiny` (pyproject.toml); a deployment without SERVED_MODELS serves `demo`.
    probe = (
        "import django; django.setup(); from django.conf import settings; "
        "from sessions.serializers import DEFAULT_MODEL; "
        "print(settings.STREAMSERVE['SERVED_MODELS'], DEFAULT_MODEL)"
    )
    env = {k: v for k, v in os.environ.items() if k != "SERVED_MODELS"}
    env.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip() == "['demo'] demo", result.stderr
