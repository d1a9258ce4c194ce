"""The rank-local media registry of parallel engines (runtime/executor/, multimodal/transport.py), without
processes: fake ranks answer the driver's RPCs in turn. The 2-process runs are in tests/test_parallel.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from compiled_llm.multimodal import transport
from compiled_llm.multimodal.inputs import MediaItem, MultiModalInputs, tensor_hash
from compiled_llm.runtime.executor.multiproc import MultiProcExecutor
from compiled_llm.runtime.executor.worker import MEDIA_FAULT_ENV, RankWorker


def fake_rank(rank: int, first_stage: bool = True) -> RankWorker:
    w = RankWorker.__new__(RankWorker)  # no model: only the registry methods are used
    w.ps = SimpleNamespace(rank=rank, is_first_stage=first_stage)
    w.runner = SimpleNamespace(device=torch.device("cpu"))
    w.media = {}
    return w


def fake_driver(ranks: list[RankWorker], share_memory: bool = True) -> MultiProcExecutor:
    pr = MultiProcExecutor.__new__(MultiProcExecutor)
    pr.ranks_share_memory = share_memory
    pr.calls = []

    def rpc(method, *args, gather=True):
        pr.calls.append(method)
        return [getattr(w, method)(*args) for w in ranks]

    pr.collective_rpc = rpc
    return pr


def media() -> MultiModalInputs:
    g = torch.Generator().manual_seed(0)
    img = {"pixel_values": torch.randn(1, 20, 48, generator=g).to(torch.bfloat16),
           "image_position_ids": torch.randint(0, 9, (1, 20, 2), generator=g)}
    aud = {"input_features": torch.randn(1, 30, 128, generator=g),
           "input_features_mask": torch.rand(1, 30, generator=g) > 0.3}
    return MultiModalInputs([MediaItem("image", img, torch.arange(3, 8), tensor_hash("image", img)),
                             MediaItem("audio", aud, torch.arange(10, 14), tensor_hash("audio", aud))])


def segments() -> list[str]:
    return [n for n in os.listdir(transport.SHM_DIR) if n.startswith(f"{transport.PREFIX}{os.getpid()}-")]


def check_copies(rank: RankWorker, mm: MultiModalInputs) -> None:
    got = rank.media["r1"].items
    assert [(m, n) for m, n, _ in got] == [(it.modality, it.positions.numel()) for it in mm.items]
    for (_, _, tensors), it in zip(got, mm.items):
        assert tensors.keys() == it.tensors.keys()
        for name, t in it.tensors.items():
            assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t)
            assert tensors[name].data_ptr() != t.data_ptr()  # the rank's own copy


@pytest.mark.parametrize("share_memory", [True, False])
def test_every_rank_gets_its_own_copy_and_the_segment_goes(share_memory):
    ranks = [fake_rank(0), fake_rank(1), fake_rank(2, first_stage=False)]
    driver, mm = fake_driver(ranks, share_memory), media()
    driver.register_media("r1", mm)
    check_copies(ranks[0], mm)
    check_copies(ranks[1], mm)
    assert ranks[2].media == {}  # a later pipeline stage has no towers: it keeps nothing
    assert segments() == []  # unlinked once every rank copied
    driver.release_media(["r1"])
    assert [r.media_requests() for r in ranks] == [[], [], []]


def test_a_failing_rank_rolls_back_every_rank(monkeypatch):
    ranks = [fake_rank(0), fake_rank(1), fake_rank(2)]
    driver = fake_driver(ranks)
    monkeypatch.setenv(MEDIA_FAULT_ENV, "1:bad")
    with pytest.raises(ValueError, match=r"on rank 1: RuntimeError: media registration fault injected on rank 1"):
        driver.register_media("bad", media())
    assert driver.calls == ["register_media", "release_media"]
    assert [r.media_requests() for r in ranks] == [[], [], []]  # ranks 0 and 2 had registered: rolled back
    assert segments() == []
    driver.register_media("good", media())  # the ranks keep serving
    assert [r.media_requests() for r in ranks] == [["good"]] * 3


def test_registration_errors_are_returned_not_raised():
    rank = fake_rank(0)
    m = transport.pack([(it.modality, 1, it.tensors) for it in media().items])
    transport.unlink(m)  # a segment that is gone: the rank reports the OS error text
    err = rank.register_media("r", m)
    assert err and "No such file" in err and rank.media == {}


def test_engine_registers_once_and_releases_on_finish_and_abort(tmp_path, monkeypatch):
    """The engine's side, on a one-process engine given a fake registry."""
    from compiled_llm import LLM, SamplingParams
    from multimodal_tiny import image, make_mm_checkpoint

    make_mm_checkpoint(tmp_path, audio=False)
    llm = LLM(str(tmp_path), enforce_eager=True, max_model_len=320, block_size=8)
    executor, live, log = llm.engine.executor, set(), []
    monkeypatch.setattr(executor, "register_media", lambda rid, mm: (live.add(rid), log.append(rid)))
    monkeypatch.setattr(executor, "release_media", lambda rids: live.difference_update(rids))
    prompt = {"prompt": "The quick <|image|> brown fox", "multi_modal_data": {"image": image(1)}}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, n=2)
    llm.generate([prompt, "Once upon a time"], params)
    assert len(log) == 1 and live == set()  # one registration for the n=2 request, none for text
    llm.engine.add_request("x", prompt, params)
    assert live == {"x"}
    llm.engine.abort_request("x")
    assert live == set()
