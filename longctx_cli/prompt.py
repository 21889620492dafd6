"""Prompt layout (document first, then the question) and streaming of the answer text with stop strings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_PLACEHOLDER = "\x00LONGCTX_DOCUMENT\x00"


@dataclass
class PromptLayout:
    """Token ids around the document: prefix (BOS / chat header), then the document, then `question_ids`.

    Base models (no chat template) get "DOCUMENT\\n\\nQuestion: ...\\nAnswer:" and stop strings, since nothing
    else tells them where an answer ends; chat models get their template and stop at end-of-turn / EOS.
    """

    prefix_ids: torch.Tensor  # [P] int
    question_ids: torch.Tensor  # [Q] int
    chat: bool
    stop_strings: list[str]
    stop_ids: set[int]


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def _stop_ids(tokenizer, generation_config) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    for token in ("<end_of_turn>", "<|eot_id|>", "<|im_end|>"):
        idx = tokenizer.convert_tokens_to_ids(token)
        if isinstance(idx, int) and idx != tokenizer.unk_token_id:
            ids.add(idx)
    return ids


def build_layout(tokenizer, question: str, stop: list[str], generation_config=None,
                 layout: str = "auto") -> PromptLayout:
    chat = layout == "chat" or (layout == "auto" and bool(getattr(tokenizer, "chat_template", None)))
    stop_ids = _stop_ids(tokenizer, generation_config)
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{_PLACEHOLDER}\n\n{question.strip()}"}],
            tokenize=False, add_generation_prompt=True,
        )
        head, tail = text.split(_PLACEHOLDER)
        return PromptLayout(_ids(tokenizer, head), _ids(tokenizer, tail), True, [], stop_ids)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    tail = f"\n\nQuestion: {question.strip()}\nAnswer:"
    return PromptLayout(torch.tensor(bos, dtype=torch.long), _ids(tokenizer, tail), False, list(stop), stop_ids)


class AnswerText:
    """Turns generated token ids into text pieces as they come, cutting at the first stop string.

    Text that might be the beginning of a stop string is held back until it is clearly not one.
    """

    def __init__(self, tokenizer, stop_strings: list[str], stop_ids: set[int]):
        self.tokenizer, self.stop_strings, self.stop_ids = tokenizer, [s for s in stop_strings if s], stop_ids
        self.ids: list[int] = []
        self.emitted = 0  # characters of the answer already handed out
        self.text = ""
        self.done = False

    def feed(self, token: int) -> str:
        """Returns the new text to print (maybe empty); sets `done` at a stop token or string."""
        if token in self.stop_ids:
            self.done = True
            return self._flush(len(self.text))
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (self.text.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.done = True
            self.text = self.text[:cut]
            return self._flush(cut)
        # Hold back an incomplete UTF-8 sequence and any suffix that is a prefix of a stop string.
        safe = len(self.text.rstrip("\ufffd"))
        hold = max((k for s in self.stop_strings for k in range(1, len(s)) if self.text[:safe].endswith(s[:k])),
                   default=0)
        return self._flush(safe - hold)

    def _flush(self, upto: int) -> str:
        # Base models answer "Answer: Paris" with a leading space; the printed answer starts at the text.
        lead = len(self.text) - len(self.text.lstrip())
        self.emitted = max(self.emitted, min(lead, upto))
        piece = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return piece

    def finish(self) -> str:
        """What is still held back when generation ends without a stop (length limit, Ctrl-C)."""
        return self._flush(len(self.text))

    @property
    def answer(self) -> str:
        return self.text.strip()
