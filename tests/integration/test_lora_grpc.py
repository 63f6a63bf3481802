"""LoRA adapters over gRPC on a real engine process: adapters from --lora-modules and AddLora
served beside the base model, adapters added and removed while requests run, the contract's
status codes (NOT_FOUND, INVALID_ARGUMENT naming the file, ALREADY_EXISTS, RESOURCE_EXHAUSTED),
and pinned adapters that are never moved off the device."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine_svc import LLM, LoRARequest, SamplingParams
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.integration.grpc_util import StreamSession, add_request, generate, tokens_of
from tests.integration.harness import Engine
from tests.lora_peft import make_adapter

pytestmark = pytest.mark.timeout(180)
PROMPT = [300, 301, 302, 303, 304, 305, 306]
FLAGS = ("--max-num-seqs", "8", "--kv-cache-memory", "32MiB", "--enable-lora")


@pytest.fixture(scope="module")
def adapters(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from engine_svc.default_model import ensure_default_model

    base = ensure_default_model()
    root = tmp_path_factory.mktemp("grpc_lora")
    specs = {
        "alpha": dict(r=4, alpha=8, targets="all-linear"),
        "beta": dict(r=8, alpha=16, targets=["q_proj", "v_proj"]),
        "gamma": dict(r=2, alpha=4, targets=["gate_proj", "up_proj", "down_proj"]),
        "delta": dict(r=4, alpha=8, targets=["o_proj", "k_proj"]),
        "wide": dict(r=16, alpha=16, targets=["q_proj"]),  # above --max-lora-rank 8
    }
    dirs = {
        name: make_adapter(base, root / name, seed=i + 1, **spec)  # type: ignore[arg-type]
        for i, (name, spec) in enumerate(specs.items())
    }
    broken = root / "broken"
    shutil.copytree(dirs["alpha"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x00not safetensors")
    dirs["broken"] = broken
    return dirs


@pytest.fixture(scope="module")
def expected(cache_dir: Path, adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    """Greedy tokens of PROMPT under each adapter (and the base), from the offline engine."""
    from engine_svc.default_model import ensure_default_model

    llm = LLM(ensure_default_model(), enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    out: dict[str | None, list[int]] = {}
    for i, name in enumerate([None, "alpha", "beta", "gamma", "delta"]):
        lr = None if name is None else LoRARequest(name, i, str(adapters[name]))
        res = llm.generate(
            [{"prompt_token_ids": PROMPT}],
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
            lora_request=lr,
        )
        out[name] = res[0].outputs[0].token_ids
    assert len({tuple(v) for v in out.values()}) == 5  # every adapter changes the output
    return out


@pytest.fixture(scope="module")
def lora_engine(
    cache_dir: Path, log_dir: Path, adapters: dict[str, Path]
) -> Iterator[pb_grpc.EngineStub]:
    e = Engine(
        cache_dir,
        log_dir,
        *FLAGS,
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"alpha={adapters['alpha']}",
        f"beta={adapters['beta']}",
    )
    try:
        e.wait_ready()
        with grpc.insecure_channel(e.address) as ch:
            yield pb_grpc.EngineStub(ch)
    finally:
        e.stop()


def lora_request(rid: str, name: str | None, max_tokens: int = 24) -> pb.AddRequest:
    request = add_request(rid, PROMPT, max_tokens)
    if name:
        request.lora_name = name
    return request


def status_of(call) -> grpc.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def names(stub: pb_grpc.EngineStub) -> list[str]:
    return [lo.lora_name for lo in stub.ListLoras(pb.ListLorasRequest()).loras]


def test_model_info_and_startup_adapters(
    lora_engine: pb_grpc.EngineStub, adapters: dict[str, Path]
) -> None:
    info = lora_engine.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.max_loras, info.max_lora_rank) == (2, 8)
    listed = {lo.lora_name: lo for lo in lora_engine.ListLoras(pb.ListLorasRequest()).loras}
    assert listed["alpha"].lora_path == str(adapters["alpha"]) and listed["alpha"].rank == 4
    assert listed["beta"].rank == 8 and not listed["beta"].pinned


def test_adapters_and_base_over_the_wire(
    lora_engine: pb_grpc.EngineStub, expected: dict[str | None, list[int]]
) -> None:
    for name in (None, "alpha", "beta"):
        got = tokens_of(generate(lora_engine, lora_request(f"w-{name}", name)))
        assert got == expected[name], name
    # one Stream mixing them: each request keeps its own adapter
    session = StreamSession(lora_engine)
    for i, name in enumerate(("alpha", None, "beta", "alpha")):
        session.add(lora_request(f"s{i}-{name}", name))
    session.half_close()
    tokens: dict[str, list[int]] = {}
    for message in session:
        assert not message.errors
        for out in message.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for rid, got in tokens.items():
        name = rid.split("-")[1]
        assert got == expected[None if name == "None" else name], rid


def test_unknown_adapter_is_not_found(lora_engine: pb_grpc.EngineStub) -> None:
    error = status_of(lambda: generate(lora_engine, lora_request("nf", "nobody")))
    assert error.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert "nobody" in error.details()  # type: ignore[attr-defined]
    session = StreamSession(lora_engine)
    session.add(lora_request("nf-s", "nobody"))
    session.add(lora_request("ok-s", None, 3))
    session.half_close()
    errors = [e for m in session for e in m.errors]
    assert [(e.request_id, e.code) for e in errors] == [("nf-s", pb.ERROR_CODE_NOT_FOUND)]
    for rpc, msg in [
        (lora_engine.RemoveLora, pb.RemoveLoraRequest(lora_name="nobody")),
        (lora_engine.PinLora, pb.PinLoraRequest(lora_name="nobody")),
    ]:
        error = status_of(lambda rpc=rpc, msg=msg: rpc(msg))
        assert error.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


def test_bad_adapters_are_refused_and_the_others_keep_serving(
    lora_engine: pb_grpc.EngineStub,
    adapters: dict[str, Path],
    expected: dict[str | None, list[int]],
) -> None:
    broken = adapters["broken"]
    cases = [
        (pb.AddLoraRequest(lora_name="b1", lora_path=str(broken)), "adapter_model.safetensors"),
        (pb.AddLoraRequest(lora_name="b3", lora_path=str(adapters["wide"])), "max-lora-rank 8"),
        (pb.AddLoraRequest(lora_name="", lora_path=str(adapters["gamma"])), "lora_name"),
        (pb.AddLoraRequest(lora_name="b4", lora_path=""), "lora_path"),
    ]
    for request, fragment in cases:
        error = status_of(lambda request=request: lora_engine.AddLora(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, fragment  # type: ignore[attr-defined]
        assert fragment in error.details(), error.details()  # type: ignore[attr-defined]
    # A path that is not there: NOT_FOUND (vLLM answers such a load 404).
    missing = pb.AddLoraRequest(lora_name="b2", lora_path=str(broken / "nope"))
    error = status_of(lambda: lora_engine.AddLora(missing))
    assert error.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert "nope: no such adapter directory" in error.details()  # type: ignore[attr-defined]
    assert (
        str(broken / "adapter_model.safetensors")
        in status_of(lambda: lora_engine.AddLora(cases[0][0])).details()
    )  # type: ignore[attr-defined]
    error = status_of(
        lambda: lora_engine.AddLora(
            pb.AddLoraRequest(lora_name="alpha", lora_path=str(adapters["gamma"]))
        )
    )
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS  # type: ignore[attr-defined]
    assert not {"b1", "b2", "b3", "b4"} & set(names(lora_engine))
    assert tokens_of(generate(lora_engine, lora_request("still", "alpha"))) == expected["alpha"]


def test_add_and_remove_while_requests_run(
    lora_engine: pb_grpc.EngineStub,
    adapters: dict[str, Path],
    expected: dict[str | None, list[int]],
) -> None:
    long = 400  # tokens: the running requests outlive the adapter calls below
    session = StreamSession(lora_engine, timeout=120)
    session.add(lora_request("long-alpha", "alpha", long))
    session.add(lora_request("long-base", None, long))
    tokens: dict[str, list[int]] = {}
    finish: dict[str, int] = {}
    added = False
    for message in session:
        assert not message.errors, message.errors
        for out in message.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[out.request_id] = out.finish_reason
        if not added and tokens:
            # both running: add gamma, use it in the same stream, then remove alpha under load
            info = lora_engine.AddLora(
                pb.AddLoraRequest(lora_name="gamma", lora_path=str(adapters["gamma"]))
            ).lora
            assert (info.lora_name, info.rank, info.pinned) == ("gamma", 2, False)
            session.add(lora_request("new-gamma", "gamma"))
            lora_engine.RemoveLora(pb.RemoveLoraRequest(lora_name="alpha"))
            assert "alpha" not in names(lora_engine)
            error = status_of(lambda: generate(lora_engine, lora_request("late", "alpha")))
            assert error.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
            # and the request under alpha was still running after the removal (a faster engine
            # that finished it first would leave this test checking less than it says)
            probe = generate(lora_engine, lora_request("probe", None, 2))[0]
            assert "alpha" in probe.load.running_lora_adapters, probe.load
            added = True
        if len(finish) == 3:
            session.half_close()
    assert finish == {r: pb.FINISH_REASON_LENGTH for r in ("long-alpha", "long-base", "new-gamma")}
    # the request already running with alpha finished with alpha's weights
    assert tokens["long-alpha"][:24] == expected["alpha"] and len(tokens["long-alpha"]) == long
    assert tokens["long-base"][:24] == expected[None]
    assert tokens["new-gamma"] == expected["gamma"]
    # the name is free again; the adapter loaded under it is a new one
    lora_engine.AddLora(pb.AddLoraRequest(lora_name="alpha", lora_path=str(adapters["alpha"])))
    assert tokens_of(generate(lora_engine, lora_request("back", "alpha"))) == expected["alpha"]


def test_pinned_adapter_stays_on_the_device(
    cache_dir: Path,
    log_dir: Path,
    adapters: dict[str, Path],
    expected: dict[str | None, list[int]],
) -> None:
    e = Engine(cache_dir, log_dir, *FLAGS, "--max-loras", "2", "--max-lora-rank", "8")
    try:
        e.wait_ready()
        with grpc.insecure_channel(e.address) as ch:
            stub = pb_grpc.EngineStub(ch)
            for name in ("alpha", "beta", "gamma"):
                stub.AddLora(pb.AddLoraRequest(lora_name=name, lora_path=str(adapters[name])))
            stub.AddLora(
                pb.AddLoraRequest(lora_name="delta", lora_path=str(adapters["delta"]), pin=True)
            )

            def listed() -> dict[str, pb.LoraInfo]:
                return {lo.lora_name: lo for lo in stub.ListLoras(pb.ListLorasRequest()).loras}

            assert listed()["delta"].pinned and listed()["delta"].on_device
            # the three unpinned adapters take turns in the one slot left
            for name in ("alpha", "beta", "gamma", "alpha", None, "delta", "beta"):
                got = tokens_of(generate(stub, lora_request(f"p-{name}", name)))
                assert got == expected[name], name
                state = listed()
                assert state["delta"].on_device
                assert [lo.on_device for lo in state.values()].count(True) <= 2
                if name not in (None, "delta"):
                    assert state[name].on_device
            # pinning the last slot would leave the others no room: refused only while
            # requests wait for them; with none waiting it is allowed, and then they are refused
            stub.PinLora(pb.PinLoraRequest(lora_name="alpha"))
            assert listed()["alpha"].pinned and listed()["alpha"].on_device
            error = status_of(lambda: generate(stub, lora_request("p-full", "beta")))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            error = status_of(lambda: stub.PinLora(pb.PinLoraRequest(lora_name="gamma")))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            # removing a pinned adapter frees its slot for the others again
            stub.RemoveLora(pb.RemoveLoraRequest(lora_name="alpha"))
            assert tokens_of(generate(stub, lora_request("p-after", "beta"))) == expected["beta"]
    finally:
        e.stop()


def test_engine_without_lora(lora_free: pb_grpc.EngineStub, adapters: dict[str, Path]) -> None:
    info = lora_free.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.max_loras, info.max_lora_rank) == (0, 0)
    assert names(lora_free) == []
    error = status_of(
        lambda: lora_free.AddLora(
            pb.AddLoraRequest(lora_name="alpha", lora_path=str(adapters["alpha"]))
        )
    )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert "--enable-lora" in error.details()  # type: ignore[attr-defined]
    error = status_of(lambda: generate(lora_free, lora_request("x", "alpha")))
    assert error.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


@pytest.fixture()
def lora_free(channel: grpc.Channel) -> pb_grpc.EngineStub:
    """The session's shared engine, started without --enable-lora."""
    return pb_grpc.EngineStub(channel)


def test_bad_startup_adapter_stops_the_engine(
    cache_dir: Path, log_dir: Path, adapters: dict[str, Path]
) -> None:
    e = Engine(
        cache_dir,
        log_dir,
        *FLAGS,
        "--lora-modules",
        f"x={adapters['broken']}",
        "--max-lora-rank",
        "8",
    )
    try:
        assert e.wait(60) != 0
        assert str(adapters["broken"] / "adapter_model.safetensors") in e.log_tail()
    finally:
        e.kill()
