"""`run_accuracy` hands its result to `on_rows` after every sample, so that a stopped run keeps what it finished
(engines and prompts stubbed: no model)."""

from __future__ import annotations

from types import SimpleNamespace

from longctx_cli import accuracy


def test_every_sample_is_saved_and_unfinished_rows_say_partial(monkeypatch):
    class Builder:
        def __init__(self, *args):
            pass

        def overhead(self):
            return 0

    def generate(task, length, n, tokenizer, **kwargs):
        return [SimpleNamespace(index=i, prompt_hash=f"{task}{length}{i}", depths=[0.5], expected=["x"])
                for i in range(n)]

    scores = {("resa", 0): 100.0, ("resa", 1): 0.0, ("resa", 2): 100.0}
    monkeypatch.setattr(accuracy, "PromptBuilder", Builder)
    monkeypatch.setattr(accuracy, "generate", generate)
    monkeypatch.setattr(accuracy, "_run", lambda prof, engine, builder, sample, budget: {
        "score": scores.get((prof.name, sample.index), 100.0), "answer": "x", "prefill_s": 1.0,
        "decode_ms_per_token": 1.0})
    engines = [(SimpleNamespace(name="resa", engine="resa"), None), (SimpleNamespace(name="dense", engine="dense"), None)]
    saved = []
    result = accuracy.run_accuracy(engines, None, baseline="dense", tasks=["niah_single_1"], lengths=[1024, 2048],
                                   samples=3, seed=0, depths=None, max_new_tokens=16, layout="plain", stop=[],
                                   on_rows=lambda so_far: saved.append(so_far))

    # Three samples at each of two lengths: a save after each, the last of a length with its finished row.
    assert len(saved) == 6
    first = [(r["length"], r["samples"], r["score"], r.get("partial", False)) for r in saved[0]["rows"]]
    assert first == [(1024, 1, 100.0, True)] and len(saved[0]["samples"]) == 1
    assert [(r["samples"], r["score"], r.get("partial", False)) for r in saved[1]["rows"]] == [(2, 50.0, True)]
    assert [(r["length"], r["samples"], r.get("partial", False)) for r in saved[3]["rows"]] == [
        (1024, 3, False), (2048, 1, True)]
    assert saved[-1] == result and not any(r.get("partial") for r in result["rows"])
    assert [r["dense_score"] for r in result["rows"]] == [100.0, 100.0]
    assert [r["score"] for r in result["rows"]] == [200.0 / 3, 200.0 / 3]
