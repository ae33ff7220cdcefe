"""Stage-level serving (issue 15): the stage contract, roles, hand-off links, worker processes."""

from __future__ import annotations

import threading

import pytest
import torch
from torch._C._distributed_c10d import TCPStore

from workers.runtime.models import build_model
from workers.runtime.models.causal_dit import PRESETS as DIT_PRESETS
from workers.runtime.stages.chain import StageChain, route
from workers.runtime.stages.contract import (
    ROLES,
    RoleError,
    Stage,
    StageNotHosted,
    build_staged,
    parse_role,
    stage_weight_bytes,
)
from workers.runtime.stages.link import LinkReceiver, LinkSender, connect_store, open_pair
from workers.runtime.stages.pipeline import StageMessage, StageProtocolError, StageRunner
from workers.runtime.transport.pair import SOURCE_RANK, TARGET_RANK

PROMPTS = (
    "a red circle moving left on a blue background",
    "a green square moving up on a black background",
    "a yellow triangle moving right on a white background",
)

# A stream script: (chunk step, action). Session "b" joins at step 2; "a" switches prompt twice, one
# switch superseded before it takes effect; every step runs both open sessions in one batch.
SCRIPT = [
    (0, ("open", "a", 11, PROMPTS[0])),
    (1, ("prompt", "a", PROMPTS[1], 2)),
    (2, ("open", "b", 5, PROMPTS[2])),
    (2, ("prompt", "a", PROMPTS[2], 4)),
    (3, ("prompt", "a", PROMPTS[0], 4)),  # supersedes the switch at 4 scheduled at step 2
    (4, ("prompt", "b", PROMPTS[0], 5)),
]
STEPS = 6


def monolithic_frames(model) -> list[torch.Tensor]:
    states: dict[str, object] = {}
    frames = []
    for step in range(STEPS):
        for _, action in (entry for entry in SCRIPT if entry[0] == step):
            if action[0] == "open":
                states[action[1]] = model.create_state(action[3], action[2], start_chunk=step)
            else:
                model.set_prompt(states[action[1]], action[2], action[3])
        frames.append(torch.stack([chunk.frames for chunk in model.generate(list(states.values()))]))
    return frames


def script_messages(step: int, sessions: list[str]) -> list[StageMessage]:
    messages = []
    for _, action in (entry for entry in SCRIPT if entry[0] == step):
        if action[0] == "open":
            sessions.append(action[1])
            meta = {"session": action[1], "seed": action[2], "prompt": action[3], "start_chunk": step}
            messages.append(StageMessage("open", meta))
        else:
            meta = {"session": action[1], "prompt": action[2], "from_chunk": action[3]}
            messages.append(StageMessage("prompt", meta))
    messages.append(StageMessage("step", {"sessions": list(sessions)}))
    return messages


def run_in_process(runners: list[StageRunner]) -> list[torch.Tensor]:
    sessions: list[str] = []
    frames = []
    for step in range(STEPS):
        pending = script_messages(step, sessions)
        for runner in runners:
            pending = [out for message in pending for out in runner.handle(message)]
        (message,) = pending
        assert message.kind == "frames" and message.meta["chunks"][0] == step
        frames.append(message.tensor)
    return frames


# -- the contract --------------------------------------------------------------------------------


def test_roles_parse_into_stages_in_pipeline_order():
    assert parse_role("EDC") == (Stage.ENCODE, Stage.DIFFUSE, Stage.DECODE)
    assert parse_role("dc") == (Stage.DIFFUSE, Stage.DECODE)
    assert [len(parse_role(role)) for role in ROLES] == [3, 2, 2, 1, 1, 1]


@pytest.mark.parametrize("role", ["", "EC", "CD", "EDCX", "X", "DD"])
def test_a_bad_role_is_a_clear_error(role):
    with pytest.raises(RoleError, match=r"valid roles: EDC, ED, DC, E, D, C"):
        parse_role(role)


@pytest.mark.parametrize("split", [["E", "D", "C"], ["ED", "C"], ["E", "DC"], ["EDC"]])
@pytest.mark.parametrize("preset", ["demo", "tiny"])
def test_split_pipeline_frames_are_bit_identical_to_generate(preset, split):
    # Given one worker's stages per role, each built with only its own weights,
    runners = [StageRunner(build_staged(preset, role)) for role in split]
    # when the script runs through them in one process, then every chunk equals generate's bit for bit.
    split_frames = run_in_process(runners)
    for got, want in zip(split_frames, monolithic_frames(build_model(preset, device="cpu")), strict=True):
        assert got.dtype == torch.uint8
        assert torch.equal(got, want)


@pytest.mark.parametrize("preset", ["demo", "tiny"])
def test_a_stage_worker_holds_only_the_weights_of_its_stages(preset):
    per_stage = stage_weight_bytes(preset)
    full = build_model(preset, device="cpu").net
    assert sum(per_stage.values()) == sum(p.numel() * p.element_size() for p in full.parameters())
    for role in ROLES:
        staged = build_staged(preset, role)
        assert staged.loaded_weight_bytes() == sum(per_stage[letter] for letter in role)
    encoder = build_staged(preset, "E")
    with pytest.raises(StageNotHosted, match="stage diffuse is not hosted by this E worker"):
        encoder.create_diffusion_state(0, encoder.encode(PROMPTS[0]))


def test_a_stage_worker_reads_only_its_stages_from_a_weights_file(tmp_path):
    model = build_model("tiny", device="cpu", weights_seed=3)
    path = tmp_path / "tiny.safetensors"
    model.save_weights(str(path))
    staged = build_staged("tiny", "DC", weights_path=str(path))
    own, full = staged.net.state_dict(), model.net.state_dict()
    assert set(own) == {name for name in full if not name.startswith("text.")}
    assert all(torch.equal(own[name], full[name]) for name in own)


@pytest.mark.parametrize("preset", ["tiny", "small", "wan-1.3b"])
def test_stage_weight_bytes_are_analytic_and_match_the_parameter_count(preset):
    cfg = DIT_PRESETS[preset]
    per_stage = stage_weight_bytes(preset)  # meta device: wan-1.3b allocates nothing
    assert sum(per_stage.values()) == cfg.parameter_count() * cfg.torch_dtype.itemsize
    assert per_stage["D"] > per_stage["E"] > per_stage["C"] > 0


def test_a_diffusion_worker_without_an_encoder_upstream_rejects_a_bare_open():
    runner = StageRunner(build_staged("demo", "DC"))
    with pytest.raises(StageProtocolError, match="without embeddings: no encode stage upstream"):
        runner.handle(StageMessage("open", {"session": "a", "seed": 1, "prompt": PROMPTS[0]}))


def test_a_malformed_message_is_a_protocol_error():
    runner = StageRunner(build_staged("demo", "EDC"))
    with pytest.raises(StageProtocolError, match=r"malformed open message .* KeyError\('seed'\)"):
        runner.handle(StageMessage("open", {"session": "a", "prompt": PROMPTS[0]}))


def test_a_closed_session_is_gone_from_every_stage():
    runner = StageRunner(build_staged("demo", "EDC"))
    runner.handle(StageMessage("open", {"session": "a", "seed": 1, "prompt": PROMPTS[0]}))
    assert [m.kind for m in runner.handle(StageMessage("close", {"session": "a"}))] == ["close"]
    with pytest.raises(StageProtocolError, match="session 'a' is not open on this diffusion worker"):
        runner.handle(StageMessage("step", {"sessions": ["a"]}))


def test_the_encoder_serves_repeated_prompts_from_its_cache():
    runner = StageRunner(build_staged("demo", "E"), encoding_cache_size=2)
    for session, prompt in enumerate([PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1]]):
        (out,) = runner.handle(StageMessage("open", {"session": str(session), "seed": 0, "prompt": prompt}))
        assert torch.equal(out.tensor, runner.staged.encode(prompt))
    # PROMPTS[0] came back while cached; PROMPTS[1] had been evicted by then (LRU of 2).
    assert (runner.encode_hits, runner.encode_misses) == (1, 4)


# -- hand-off links ------------------------------------------------------------------------------


def open_link(name: str, **sender_options) -> tuple[LinkSender, LinkReceiver]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    receiver: dict[str, LinkReceiver] = {}
    peer = threading.Thread(
        target=lambda: receiver.setdefault(
            # Its own client connection: a store client blocks while it waits for a key.
            "r",
            LinkReceiver(
                open_pair(
                    connect_store(f"127.0.0.1:{store.port}"), name, TARGET_RANK, device=torch.device("cpu")
                ),
                timeout_s=20,
                idle_timeout_s=20,
            ),
        )
    )
    peer.start()
    sender = LinkSender(
        open_pair(store, name, SOURCE_RANK, device=torch.device("cpu")), timeout_s=20, **sender_options
    )
    peer.join()
    return sender, receiver["r"]


def test_a_link_past_its_in_flight_bound_queues_in_host_memory_and_keeps_order():
    # Given a link whose bound admits one message in flight,
    sender, receiver = open_link("bounded", max_in_flight_bytes=64 << 10)
    generator = torch.Generator().manual_seed(0)
    messages = [
        StageMessage(
            "latents", {"sessions": [str(i)], "chunks": [i]}, torch.randn(40 << 8, generator=generator)
        )
        for i in range(8)
    ]
    try:
        # when eight 40 KiB messages are sent before the receiver takes any (a Gloo send completes
        # only once the peer receives it),
        for message in messages:
            sender.send(message)
        assert sender.queued == 7 and sender.stats.spilled_messages == 7
        # then they all arrive, in order and bit-exact, without the bound ever being exceeded.
        received = [receiver.recv() for _ in messages]
        sender.flush()
    finally:
        sender.close()
        receiver.close()
    for got, sent in zip(received, messages, strict=True):
        assert got.meta == sent.meta and torch.equal(got.tensor, sent.tensor)
    assert sender.stats.peak_in_flight_bytes <= 64 << 10
    assert sender.stats.messages == 8 and sender.in_flight_bytes == 0


# -- worker processes ----------------------------------------------------------------------------


@pytest.mark.parametrize(("preset", "roles"), [("tiny", ["E", "D", "C"]), ("demo", ["E", "DC"])])
def test_worker_processes_stream_frames_bit_identical_to_one_process(preset, roles):
    # Given one process per role, linked over Gloo pair groups (the driver's own link is bounded
    # tightly, so it spills),
    chain = StageChain(preset, roles, max_in_flight_bytes=1, timeout_s=30)
    sessions: list[str] = []
    try:
        # when a step names a session no worker knows, then the whole script before any frame is read,
        chain.send(StageMessage("step", {"sessions": ["nobody"]}))
        for step in range(STEPS):
            for message in script_messages(step, sessions):
                chain.send(message)
        error = chain.recv()
        received = [chain.recv() for _ in range(STEPS)]
        # and a close comes back from the last worker once every stage has dropped the session.
        chain.send(StageMessage("close", {"session": "a"}))
        closed = chain.recv()
    finally:
        codes = chain.close()
    # every chunk is the monolithic model's, bit for bit, and every worker exited cleanly.
    for step, (got, want) in enumerate(
        zip(received, monolithic_frames(build_model(preset, device="cpu")), strict=True)
    ):
        assert got.kind == "frames" and got.meta["chunks"] == [step] * len(got.meta["sessions"])
        assert torch.equal(got.tensor, want)
    # the bad step is answered by the diffusion worker and the stream goes on;
    assert error.kind == "error" and error.meta["message"] == "step" and "D" in error.meta["worker"]
    assert "session 'nobody' is not open on this diffusion worker" in error.meta["error"]
    assert (closed.kind, closed.meta) == ("close", {"session": "a"})
    assert chain.head.stats.spilled_messages > 0
    assert codes == [0] * len(roles)


def test_one_encoder_process_serves_two_diffusion_workers():
    # Given a shared encoder (E) routing to two DC workers, one session on each,
    chain = StageChain("tiny", ["E", "DC"], branches=2, timeout_s=30)
    model = build_model("tiny", device="cpu")
    sessions = {"a": (0, 3, PROMPTS[0]), "b": (1, 4, PROMPTS[0])}  # the same prompt: one encode serves both
    states = {name: model.create_state(prompt, seed) for name, (_, seed, prompt) in sessions.items()}
    try:
        for name, (branch, seed, prompt) in sessions.items():
            chain.send(
                StageMessage(
                    "open", {"session": name, "seed": seed, "prompt": prompt, "route": route(branch)}
                )
            )
        for step in range(3):
            if step == 1:  # a prompt switch reaches only the session it names
                chain.send(StageMessage("prompt", {"session": "b", "prompt": PROMPTS[1], "from_chunk": 2}))
                model.set_prompt(states["b"], PROMPTS[1], 2)
            for name in sessions:
                chain.send(StageMessage("step", {"sessions": [name]}))
            # then each branch streams its own session's frames, bit-identical to the model alone.
            for name, (branch, _, _) in sessions.items():
                got = chain.recv(branch)
                assert got.meta["sessions"] == [name] and got.meta["chunks"] == [step]
                assert torch.equal(got.tensor[0], model.generate([states[name]])[0].frames)
    finally:
        codes = chain.close()
    assert codes == [0, 0, 0]
