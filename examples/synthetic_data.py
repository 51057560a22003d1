"""A small deterministic corpus with something to learn: a token stream from a fixed Markov chain.

Every token has a few fixed successors with skewed probabilities, so next-token entropy is about
1.1 nats against ln(vocab) for an untrained model; the loss falls as the model learns the table.
Samples are Megatron GPT-dataset dicts, so Megatron's samplers and data loaders take them as is.
"""

import numpy as np
import torch

SUCCESSOR_PROBS = np.array([0.55, 0.25, 0.15, 0.05])


class MarkovChainDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234,
                 split: int = 0):
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.seed, self.split = seed, split
        # The chain (shared by every split) depends only on the seed and the vocabulary.
        chain_rng = np.random.default_rng(seed)
        self.successors = chain_rng.integers(0, vocab_size, size=(vocab_size, len(SUCCESSOR_PROBS)))
        # Causal mask in Megatron's convention: True marks positions a token may not attend to.
        self.attention_mask = torch.ones(1, seq_length, seq_length, dtype=torch.bool).triu(1)
        self.position_ids = torch.arange(seq_length, dtype=torch.long)
        self.loss_mask = torch.ones(seq_length, dtype=torch.float)

    def __len__(self):
        return self.num_samples

    def __getitem__(self, idx):
        rng = np.random.default_rng((self.seed, self.split, idx))
        choices = rng.choice(len(SUCCESSOR_PROBS), size=self.seq_length, p=SUCCESSOR_PROBS)
        stream = np.empty(self.seq_length + 1, dtype=np.int64)
        stream[0] = rng.integers(self.vocab_size)
        for i, choice in enumerate(choices):
            stream[i + 1] = self.successors[stream[i], choice]
        stream = torch.from_numpy(stream)
        return {
            'tokens': stream[:-1],
            'labels': stream[1:],
            'loss_mask': self.loss_mask,
            'attention_mask': self.attention_mask,
            'position_ids': self.position_ids,
        }


def markov_chain_datasets(num_samples, seq_length, vocab_size, seed=1234):
    """Train, validation and test datasets of the given sizes (Megatron's num_samples triple)."""
    return tuple(MarkovChainDataset(max(n, 1), seq_length, vocab_size, seed, split)
                 for split, n in enumerate(num_samples))
