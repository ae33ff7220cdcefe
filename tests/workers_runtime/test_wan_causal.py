"""The Wan2.1-family adapter on tiny random checkpoints saved in the published layouts.

Loading (the diffusers layout; the Self-Forcing, LongLive and CausVid generator checkpoints over it),
the streaming step against the libraries' own whole-clip forward and decode, batching across stream
positions, the prompt switch with KV re-cache, split stage pipelines (issue 15) against `generate`,
and layout errors that name the parameter and file.
The model-contract tests of the built-in model run on this adapter in test_wan_contract.py.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from contracts.catalog.local_paths import ModelLayoutError, read_wan_architecture
from tests.workers_runtime.wan_layouts import (
    write_diffusers_layout,
    write_generator_checkpoint,
    write_wan_layout,
)
from workers.runtime.models.wan_causal import WanCausalModel
from workers.runtime.stages.contract import parse_role
from workers.runtime.stages.pipeline import StageRunner
from workers.runtime.stages.wan_causal import WanCausalStages

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    return write_diffusers_layout(tmp_path_factory.mktemp("wan") / "Wan2.1-T2V-tiny-Diffusers")


@pytest.fixture(scope="module")
def wan_model(wan_dir):
    return WanCausalModel(read_wan_architecture(wan_dir), preset="wan-test")


def causal_copy(wan_dir, tmp_path, relative, *, ema_offset):
    root = tmp_path / "causal"
    shutil.copytree(wan_dir, root)
    write_generator_checkpoint(root, relative, ema_offset=ema_offset)
    return root


def generate_chunks(model, prompt, seed, count):
    state = model.create_state(prompt, seed)
    return state, [model.generate([state])[0].frames for _ in range(count)]


@pytest.mark.parametrize(
    ("relative", "ema_offset"),
    [
        ("checkpoints/self_forcing_dmd.pt", 0.05),  # Self-Forcing: generator + generator_ema
        ("models/longlive_base.pt", 0.05),  # LongLive's base generator
        ("autoregressive_checkpoint/model.pt", None),  # CausVid: generator only
    ],
)
def test_generator_checkpoints_load_the_same_dit_as_the_diffusers_layout(
    wan_dir, wan_model, tmp_path, relative, ema_offset
):
    # Given the causal project's checkpoint (original Wan names under `model.`) over the base layout
    root = causal_copy(wan_dir, tmp_path, relative, ema_offset=ema_offset)
    arch = read_wan_architecture(root)
    assert arch.generator_path() == root / relative
    # When the adapter loads it
    model = WanCausalModel(arch, preset="wan-test")
    # Then the DiT is the EMA (or only) generator, parameter for parameter
    expected = wan_model.net.transformer.state_dict()
    loaded = model.net.transformer.state_dict()
    assert list(loaded) == list(expected)
    for name in expected:
        assert torch.equal(loaded[name], expected[name]), name
    _, frames = generate_chunks(model, "a red fox", 3, 2)
    _, reference = generate_chunks(wan_model, "a red fox", 3, 2)
    assert all(torch.equal(a, b) for a, b in zip(frames, reference, strict=True))


def test_longlive_lora_is_merged_into_the_generator(wan_dir, wan_model, tmp_path):
    # Given LongLive's base generator and a rank-2 peft LoRA over two of its layers (alpha 4: scale 2)
    root = causal_copy(wan_dir, tmp_path, "models/longlive_base.pt", ema_offset=None)
    down, up = torch.randn(2, 24), torch.randn(24, 2)
    ffn_down, ffn_up = torch.randn(2, 24), torch.randn(32, 2)
    lora = {
        "base_model.model.blocks.0.self_attn.q.lora_A.weight": down,
        "base_model.model.blocks.0.self_attn.q.lora_B.weight": up,
        "base_model.model.blocks.1.ffn.0.lora_A.weight": ffn_down,
        "base_model.model.blocks.1.ffn.0.lora_B.weight": ffn_up,
    }
    torch.save({"generator_lora": lora}, str(root / "models" / "lora.pt"))
    settings = json.loads((root / "streamserve.json").read_text())
    (root / "streamserve.json").write_text(json.dumps(dict(settings, lora_alpha=4.0)))
    # When the adapter loads the tree
    arch = read_wan_architecture(root)
    assert arch.lora_path() == root / "models" / "lora.pt"
    merged = WanCausalModel(arch, preset="wan-test").net.transformer.state_dict()
    # Then exactly those weights moved, by alpha / rank · B A
    base = wan_model.net.transformer.state_dict()
    torch.testing.assert_close(
        merged["blocks.0.attn1.to_q.weight"], base["blocks.0.attn1.to_q.weight"] + 2 * up @ down
    )
    torch.testing.assert_close(
        merged["blocks.1.ffn.net.0.proj.weight"],
        base["blocks.1.ffn.net.0.proj.weight"] + 2 * ffn_up @ ffn_down,
    )
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed == {"blocks.0.attn1.to_q.weight", "blocks.1.ffn.net.0.proj.weight"}
    # ... and a LoRA for a layer the DiT lacks is named
    lora["base_model.model.blocks.7.self_attn.q.lora_A.weight"] = down
    lora["base_model.model.blocks.7.self_attn.q.lora_B.weight"] = up
    torch.save({"generator_lora": lora}, str(root / "models" / "lora.pt"))
    with pytest.raises(
        ModelLayoutError, match=r"lora\.pt: unexpected parameter\(s\) base_model\.model\.blocks\.7"
    ):
        WanCausalModel(arch, preset="wan-test")


def test_original_wan_release_loads_the_same_model_as_its_diffusers_twin(tmp_path):
    # Given the original Wan2.1 folder (Wan's own names, .pth pickles) and the same weights as diffusers
    original, twin = write_wan_layout(tmp_path)
    arch = read_wan_architecture(original)
    assert arch.layout == "wan" and read_wan_architecture(twin).layout == "diffusers"
    # When both load
    a = WanCausalModel(arch, preset="wan-test")
    b = WanCausalModel(read_wan_architecture(twin), preset="wan-test")
    # Then every component holds the same parameters and the streams are identical
    for part in ("text_encoder", "transformer", "vae"):
        sa, sb = getattr(a.net, part).state_dict(), getattr(b.net, part).state_dict()
        assert sa.keys() == sb.keys(), part
        assert all(torch.equal(sa[k], sb[k]) for k in sa), part
    _, frames_a = generate_chunks(a, "a red fox", 3, 2)
    _, frames_b = generate_chunks(b, "a red fox", 3, 2)
    assert all(torch.equal(x, y) for x, y in zip(frames_a, frames_b, strict=True))
    # ... and so does Self-Forcing's own tree: the release under wan_models/, the generator beside it
    project = tmp_path / "Self-Forcing"
    shutil.copytree(original, project / "wan_models" / "Wan2.1-T2V-1.3B")
    shutil.move(project / "wan_models" / "Wan2.1-T2V-1.3B" / "streamserve.json", project / "streamserve.json")
    dit_path = project / "wan_models" / "Wan2.1-T2V-1.3B" / "diffusion_pytorch_model.safetensors"
    dit = load_file(str(dit_path))
    (project / "checkpoints").mkdir()
    torch.save(
        {"generator_ema": {f"model.{k}": v for k, v in dit.items()}},
        str(project / "checkpoints" / "self_forcing_dmd.pt"),
    )
    save_file({k: v + 1.0 for k, v in dit.items()}, str(dit_path))  # the bidirectional base: not served
    arch_sf = read_wan_architecture(project)
    assert (
        arch_sf.layout == "wan"
        and arch_sf.generator_path() == project / "checkpoints" / "self_forcing_dmd.pt"
    )
    _, frames_sf = generate_chunks(WanCausalModel(arch_sf, preset="wan-test"), "a red fox", 3, 2)
    assert all(torch.equal(x, y) for x, y in zip(frames_sf, frames_b, strict=True))
    # ... and a gap in Wan's T5 pickle is named as Wan spells it
    path = original / "models_t5_umt5-xxl-enc-bf16.pth"
    t5 = torch.load(str(path), weights_only=True)
    del t5["blocks.0.ffn.fc2.weight"]
    torch.save(t5, str(path))
    with pytest.raises(
        ModelLayoutError, match=r"missing parameter\(s\) encoder\.block\.0\.layer\.1\.DenseReluDense\.wo"
    ):
        WanCausalModel(arch, preset="wan-test")


def test_first_chunk_step_equals_the_diffusers_transformer_forward(wan_dir, wan_model):
    from diffusers import WanTransformer3DModel

    # Given diffusers' own (bidirectional, whole-clip) forward of the same weights
    config = json.loads((wan_dir / "transformer" / "config.json").read_text())
    reference = WanTransformer3DModel.from_config(config).eval()
    reference.load_state_dict(load_file(str(wan_dir / "transformer" / "diffusion_pytorch_model.safetensors")))
    model, arch = wan_model, wan_model.arch
    state = model.create_state("a blue robot walking", 0)
    latents = torch.randn(1, arch.frames_per_chunk, 4, arch.latent_height, arch.latent_width)
    text = "a blue robot walking"
    tokens = model.net.tokenizer([text], padding="max_length", max_length=arch.text_len, return_tensors="pt")
    hidden = model.net.text_encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask)
    hidden = hidden.last_hidden_state * tokens.attention_mask[..., None]
    sigma = model.sigmas[1]
    with torch.inference_mode():
        expected = reference(
            latents.transpose(1, 2), torch.tensor([sigma * 1000.0]), hidden, return_dict=False
        )[0].transpose(1, 2)
        # When the streaming step runs the first chunk (an empty cache: attention inside the chunk only)
        from workers.runtime.models.causal_dit import rope_tables

        positions = torch.arange(arch.frames_per_chunk, dtype=torch.float64)[None]
        rope = rope_tables(model.rope_shape, positions, model.device)
        context = state.tensors["prompt_embeds"][None]
        got = model._forward(latents, sigma, context, rope, [state], (0, None), write_slots=None)
    # Then it predicts the same flow
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_streamed_decode_equals_decoding_the_whole_clip(wan_model):
    # Given three chunks streamed through the session's decoder cache (window holds all 6 frames)
    model, arch = wan_model, wan_model.arch
    state, chunks = generate_chunks(model, "waves at dusk", 5, 3)
    frames = arch.frames_per_chunk * 3
    assert frames <= arch.window_frames
    latents = state.tensors["latent_window"][:frames].clone()  # slots 0.. hold frames 0.. in order
    # When the library decodes the whole clip at once
    vae = model.net.vae
    z = latents.transpose(0, 1)[None] * model.latents_std + model.latents_mean
    with torch.inference_mode():
        video = vae.decode(z, return_dict=False)[0]  # [1, 3, 1 + 4*(F-1), H, W]
    whole = ((video.float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 3, 0)
    # Then the stream is the same video (its first image is held for the first 4 frames)
    streamed = torch.cat(chunks)
    hold = arch.temporal_upsample - 1
    assert streamed.shape[0] == whole.shape[0] + hold
    assert all(torch.equal(streamed[i], streamed[hold]) for i in range(hold))
    diff = (streamed[hold:].int() - whole.int()).abs()
    assert diff.max().item() <= 1


def test_chunk_step_batched_across_positions_matches_per_session_steps(wan_model):
    model = wan_model
    # Given sessions at different stream positions (empty, partly full, full, wrapped ring)
    prompts = ["a red fox", "a quiet lake", "city at night", "storm over the sea"]
    warmups = [0, 1, 3, 5]
    alone, batched = [], []
    for i, (prompt, warmup) in enumerate(zip(prompts, warmups, strict=True)):
        for bucket in (alone, batched):
            state = model.create_state(prompt, 10 + i)
            for _ in range(warmup):
                model.generate([state])
            bucket.append(state)
    # When one batched step runs them all, and each alone
    for _ in range(2):
        together = model.generate(batched)
        separate = [model.generate([state])[0] for state in alone]
        # Then frames and every state tensor agree (up to floating-point rounding)
        for a, b in zip(separate, together, strict=True):
            assert a.chunk_index == b.chunk_index
            assert (a.frames.int() - b.frames.int()).abs().max().item() <= 1
    for a, b in zip(alone, batched, strict=True):
        assert a.meta == b.meta
        for name in a.tensors:
            torch.testing.assert_close(a.tensors[name], b.tensors[name], rtol=1e-4, atol=1e-4, msg=name)


def test_prompt_switch_recaches_the_window_under_the_new_prompt(wan_model):
    model = wan_model
    plain = WanCausalModel.__new__(WanCausalModel)
    plain.__dict__.update(model.__dict__)
    plain.arch = replace(model.arch, kv_recache=False)
    # Given two sessions that switch prompt at chunk 2, one model re-caching, one not
    switched, kept = model.create_state("a red fox", 4), plain.create_state("a red fox", 4)
    for m, s in ((model, switched), (plain, kept)):
        m.set_prompt(s, "a green robot", from_chunk=2)
        m.generate([s])
        m.generate([s])
    assert torch.equal(switched.tensors["kv_cache"], kept.tensors["kv_cache"])
    before = switched.tensors["kv_cache"].clone()
    # When the switch takes effect
    a = model.generate([switched])[0].frames
    b = plain.generate([kept])[0].frames
    # Then the re-cached keys of the frames held before the switch were recomputed
    fpc = model.arch.frames_per_chunk
    held = list(range(2 * fpc))
    assert not torch.equal(switched.tensors["kv_cache"][:, :, held], before[:, :, held])
    assert torch.equal(kept.tensors["kv_cache"][:, :, held], before[:, :, held])
    assert not torch.equal(a, b)
    # ... and the first chunk's keys are exactly what caching its latents under the new prompt gives
    fresh = model.create_state("a green robot", 4)
    from workers.runtime.models.causal_dit import rope_tables

    latents = switched.tensors["latent_window"][:fpc][None]
    rope = rope_tables(model.rope_shape, torch.arange(fpc, dtype=torch.float64)[None], model.device)
    with torch.inference_mode():
        model._forward(
            latents, 0.0, fresh.tensors["prompt_embeds"][None], rope, [fresh], (0, None),
            write_slots=torch.arange(fpc)[None],
        )  # fmt: skip
    torch.testing.assert_close(
        switched.tensors["kv_cache"][:, :, :fpc], fresh.tensors["kv_cache"][:, :, :fpc]
    )


def test_prompt_switch_with_recache_survives_suspend_and_migration_byte_exact(wan_model):
    model = wan_model
    straight = model.create_state("a cat", 2)
    moved = model.create_state("a cat", 2)
    for state in (straight, moved):
        model.set_prompt(state, "a dog running", from_chunk=2)
        model.generate([state])
    manifest = model.state_manifest(moved, checksums=True)
    moved = model.restore_state(
        json.loads(json.dumps(manifest)), {k: v.clone() for k, v in moved.tensors.items()}
    )
    for _ in range(3):
        a = model.generate([straight])[0].frames
        b = model.generate([moved])[0].frames
        assert torch.equal(a, b)
    for name in straight.tensors:
        assert torch.equal(straight.tensors[name], moved.tensors[name]), name


@pytest.mark.parametrize("split", [["E", "DC"], ["ED", "C"]])
def test_split_stages_are_bit_identical_to_generate_and_load_only_their_components(wan_dir, split):
    from tests.workers_runtime.test_stages import monolithic_frames, run_in_process

    # Given stage workers of the re-caching tiny Wan, each loading only its stages' components,
    arch = replace(read_wan_architecture(wan_dir), kv_recache=True)
    staged = [WanCausalStages.build(arch, preset="wan-test", stages=parse_role(role)) for role in split]
    nets = {role: s.model.net for role, s in zip(split, staged, strict=True)}
    if "E" in nets:  # an encode-only worker: UMT5 and the DiT's text projection, nothing else
        dit = nets["E"].transformer
        held = {name for name, p in dit.named_parameters() if not p.is_meta}
        assert held and all(name.startswith("condition_embedder.text_embedder.") for name in held)
        assert all(p.is_meta for p in nets["E"].vae.parameters())
    if "DC" in nets:  # a diffusion + decode worker holds no text encoder
        assert nets["DC"].text_encoder is None and nets["DC"].tokenizer is None
    letters = {"text_encoder": "E", "transformer": "D", "vae": "C"}
    for role, net in nets.items():
        assert net.components == {name for name, letter in letters.items() if letter in role}
    # when the stage script (prompt switches included) runs through them, then every chunk equals
    # the monolithic model's bit for bit.
    runners = [StageRunner(s) for s in staged]
    want = monolithic_frames(WanCausalModel(arch, preset="wan-test"))
    for got, expected in zip(run_in_process(runners), want, strict=True):
        assert torch.equal(got, expected)


# -- layout errors ---------------------------------------------------------------------------------


def test_missing_parameter_is_named_with_its_file(wan_dir, tmp_path):
    root = tmp_path / "broken"
    shutil.copytree(wan_dir, root)
    path = root / "transformer" / "diffusion_pytorch_model.safetensors"
    weights = load_file(str(path))
    del weights["blocks.1.attn2.to_k.weight"]
    save_file(weights, str(path))
    with pytest.raises(ModelLayoutError) as excinfo:
        WanCausalModel(read_wan_architecture(root), preset="wan-test")
    assert "missing parameter(s) blocks.1.attn2.to_k.weight" in str(excinfo.value)
    assert str(path) in str(excinfo.value)


def test_unexpected_checkpoint_parameter_is_named_as_the_file_spells_it(wan_dir, tmp_path):
    root = causal_copy(wan_dir, tmp_path, "checkpoints/self_forcing_dmd.pt", ema_offset=0.0)
    path = root / "checkpoints" / "self_forcing_dmd.pt"
    checkpoint = torch.load(str(path), weights_only=True)
    checkpoint["generator_ema"]["model.blocks.0.self_attn.q_extra.weight"] = torch.zeros(2)
    torch.save(checkpoint, str(path))
    with pytest.raises(ModelLayoutError) as excinfo:
        WanCausalModel(read_wan_architecture(root), preset="wan-test")
    message = str(excinfo.value)
    assert "unexpected parameter(s) model.blocks.0.self_attn.q_extra.weight" in message
    assert str(path) in message


def test_wrong_shape_and_text_encoder_gaps_are_named(wan_dir, tmp_path):
    root = tmp_path / "broken"
    shutil.copytree(wan_dir, root)
    vae_path = root / "vae" / "diffusion_pytorch_model.safetensors"
    weights = load_file(str(vae_path))
    weights["post_quant_conv.weight"] = torch.zeros(1)
    save_file(weights, str(vae_path))
    with pytest.raises(ModelLayoutError, match=r"parameter post_quant_conv\.weight has shape \(1,\)"):
        WanCausalModel(read_wan_architecture(root), preset="wan-test")
    shutil.copy(wan_dir / "vae" / "diffusion_pytorch_model.safetensors", vae_path)
    text_path = root / "text_encoder" / "model.safetensors"
    weights = load_file(str(text_path))
    dropped = next(k for k in weights if "layer.1.DenseReluDense.wo" in k)
    del weights[dropped]
    save_file(weights, str(text_path), metadata={"format": "pt"})
    with pytest.raises(ModelLayoutError, match=r"text_encoder: missing parameter\(s\) .*DenseReluDense\.wo"):
        WanCausalModel(read_wan_architecture(root), preset="wan-test")


def test_missing_component_and_unknown_setting_are_named(wan_dir, tmp_path):
    root = tmp_path / "partial"
    shutil.copytree(wan_dir, root)
    shutil.rmtree(root / "vae")
    with pytest.raises(ModelLayoutError, match=r"partial/vae: missing"):
        read_wan_architecture(root)
    shutil.copytree(wan_dir / "vae", root / "vae")
    (root / "streamserve.json").write_text(json.dumps({"window": 4}))
    with pytest.raises(ModelLayoutError, match=r"unknown setting\(s\) \['window'\]"):
        read_wan_architecture(root)
    (root / "streamserve.json").write_text(json.dumps({"generator_checkpoint": "nope.pt"}))
    with pytest.raises(ModelLayoutError, match=r"nope\.pt: generator_checkpoint"):
        read_wan_architecture(root).generator_path()


def test_state_size_formula_matches_the_allocation(wan_model):
    state = wan_model.create_state("p", 0)
    assert state.nbytes == wan_model.state_bytes_for() == state.region.numel()
    names = list(state.tensors)
    assert names[:3] == ["kv_cache", "prompt_embeds", "latent_window"]
    assert all(name.startswith("vae_cache.") for name in names[3:]) and len(names) > 3


# -- MODEL_PATHS -----------------------------------------------------------------------------------


def test_model_paths_registers_a_catalogue_preset_at_startup(wan_dir):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = (
        "import django, json; django.setup();"
        "from django.conf import settings; from contracts.catalog import PRESETS;"
        "from workers.runtime.models import model_class; p = PRESETS['wan-local'];"
        "print(json.dumps([p.default_resolution, p.fps, p.frames_per_chunk, "
        "settings.STREAMSERVE['SERVED_MODELS'], model_class('wan-local').__name__]))"
    )
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="controlplane.settings", MODEL_PATHS=f"wan-local={wan_dir}")
    env.pop("SERVED_MODELS", None)
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    resolution, fps, frames, served, cls = json.loads(done.stdout.strip().splitlines()[-1])
    assert (resolution, fps, frames, cls) == ("64x64", 8, 8, "WanCausalModel")
    assert "wan-local" in served
    env["MODEL_PATHS"] = f"wan-local={wan_dir / 'vae'}"
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "MODEL_PATHS" in done.stderr and "transformer: missing" in done.stderr


def test_bfloat16_path_as_on_a_gpu(wan_dir):
    # The CUDA dtype, exercised on CPU: caches in bfloat16, modulation and norms kept in float32
    model = WanCausalModel(read_wan_architecture(wan_dir), preset="wan-test", dtype="bfloat16")
    assert model.net.transformer.blocks[0].scale_shift_table.dtype == torch.float32
    assert model.net.transformer.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    a, b = model.create_state("a red fox", 1), model.create_state("a dog", 2)
    model.generate([a])
    model.set_prompt(a, "a cat", 2)
    for _ in range(2):
        chunks = model.generate([a, b])
        assert [c.frames.shape for c in chunks] == [(8, 64, 64, 3)] * 2
    assert a.tensors["kv_cache"].dtype == a.tensors["vae_cache.00"].dtype == torch.bfloat16
    assert a.meta["active_prompt"] == "a cat" and a.nbytes == model.state_bytes_for()
