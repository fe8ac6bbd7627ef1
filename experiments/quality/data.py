"""Training data for the quality experiment: synthetic task samples and standard-library text, packed.

Each sequence is ``seq_len + 1`` token ids (inputs and shifted labels) with a per-token loss weight: answer tokens
weigh ``answer_weight``, everything else 1. Pieces are separated by EOS. Task samples come from the "train" split of
the standard library (the evaluation uses the "eval" split), at lengths drawn log-uniformly (many short samples,
quick to learn from) or uniformly (as many long ones as short, for retrieval over the whole sequence).
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from hf_nosa.eval.corpus import corpus_text
from hf_nosa.eval.tasks import TokenCounter, make_sample
from hf_nosa.modeling.tokenizer import SPECIAL_TOKENS, build_tokenizer, byte_ids

EOS = SPECIAL_TOKENS.index("</s>")


class PackedStream(torch.utils.data.IterableDataset):
    """Endless packed sequences: ``(ids [seq_len + 1] long, weights [seq_len + 1] float)``.

    Args:
        tasks: task names mixed in uniformly; ``task_share`` of the pieces are task samples, the rest text.
        min_task_len: shortest task sample (tokens); the longest is what is left of the sequence.
    """

    def __init__(self, seq_len: int, *, tasks, task_share: float, min_task_len: int, answer_weight: float, seed: int,
                 lengths: str = "loguniform"):
        super().__init__()
        if lengths not in ("loguniform", "uniform"):
            raise ValueError(f"lengths={lengths!r} is invalid; allowed values are ('loguniform', 'uniform')")
        self.seq_len, self.tasks, self.task_share = seq_len, list(tasks), task_share
        self.min_task_len, self.answer_weight, self.seed, self.lengths = min_task_len, answer_weight, seed, lengths

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        rng = random.Random(f"train|{self.seed}|{self.seq_len}|{worker}")
        tokenizer = build_tokenizer()
        counter = TokenCounter(tokenizer)
        text = corpus_text("train")
        while True:
            yield self._sequence(rng, tokenizer, counter, text)

    def _sequence(self, rng, tokenizer, counter, text):
        need = self.seq_len + 1
        ids, weights, used = [], [], 0
        while used < need:
            room = need - used
            sample = None
            if self.tasks and rng.random() < self.task_share and room >= self.min_task_len + 64:
                task = rng.choice(self.tasks)
                if self.lengths == "uniform":
                    length = rng.randint(self.min_task_len, room - 64)
                else:
                    length = int(math.exp(rng.uniform(math.log(self.min_task_len), math.log(room - 64))))
                try:
                    sample = make_sample(task, rng, length, tokenizer, split="train", counter=counter)
                except ValueError:  # too short for this task's needles: text fills the room instead
                    sample = None
            if sample is not None:
                prompt, answer = byte_ids(sample.prompt), byte_ids(sample.target + "\n")
                pieces = [(prompt, 1.0), (answer, self.answer_weight)]
            else:
                start = rng.randrange(len(text) - need)
                n = min(room, rng.randint(256, max(256, need)))
                pieces = [(byte_ids(text[start : start + n])[:n], 1.0)]
            pieces.append((np.array([EOS]), 1.0))
            for piece, weight in pieces:
                ids.append(piece)
                weights.append(np.full(len(piece), weight, dtype=np.float32))
                used += len(piece)
        ids = np.concatenate(ids)[:need]
        weights = np.concatenate(weights)[:need]
        return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(weights)


def loader(stream: PackedStream, batch_size: int, workers: int):
    """Batches ``(ids [B, L + 1], weights [B, L + 1])`` from ``workers`` processes (0: in this process)."""
    return torch.utils.data.DataLoader(
        stream, batch_size=batch_size, num_workers=workers, persistent_workers=workers > 0, prefetch_factor=4 if workers else None
    )
