"""ShowAttendTell: the encoder and the attention decoder as one plain nn.Module, with the paper's loss."""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from captioner.errors import ConfigError
from captioner.models.beam_search import beam_search
from captioner.models.compiling import compile_function
from captioner.models.decoder import AttentionDecoder
from captioner.models.decoding import LENGTH_PENALTY, Generation, Samples, greedy_search, sample_captions
from captioner.models.encoder import Encoder


def bucket_steps(steps: int) -> int:
    """The steps (words to predict) that the fixed-shape step runs for a batch whose longest caption has `steps`:
    a multiple of 4 up to 16, of 8 up to 32, of 16 up to 64, and so on. A compiled step meets few shapes (COCO's
    batches: 12, 16, 24, 32, 48), and at most a third of a batch's steps beyond 16 are padding."""
    size = 4
    while steps > 4 * size:
        size *= 2
    return -(-steps // size) * size


def pad_to_bucket(captions: torch.Tensor, pad_index: int) -> torch.Tensor:
    """Captions (B,T) padded with `pad_index` to (B,T') where T'-1 is `bucket_steps(T-1)`. Only the tensor's shape is
    read, never its values: no host sync."""
    steps = captions.size(1) - 1
    return F.pad(captions, (0, bucket_steps(steps) - steps), value=pad_index)


def compile_options(device_type: str, accumulate: int = 1, backend: str | None = None) -> tuple[dict, str | None]:
    """torch.compile's options for the training step (`ShowAttendTell.compile_training_step`), and a line to log
    about them.

    On CUDA, mode="reduce-overhead": the step's many small kernels are captured as CUDA graphs and replayed, a launch
    each. A graph's outputs live in its own memory, which its next replay overwrites, and the gradients of the first
    of several accumulated batches are such outputs (a known PyTorch limitation): with `accumulate` > 1 the step is
    compiled without CUDA graphs."""
    options = {"backend": backend} if backend else {}
    if device_type != "cuda":
        return options, None
    if accumulate > 1:
        note = (
            f"compiled step: without CUDA graphs, since gradients are accumulated over {accumulate} batches (a graph's "
            "next replay would overwrite them)"
        )
        return options, note
    return {**options, "mode": "reduce-overhead"}, None


class Loss(NamedTuple):
    """The training objective and its parts, each averaged as logged."""

    loss: torch.Tensor  # -log P(y|x) per caption + alpha_c * doubly stochastic term (+ the entropy penalty)
    nll_per_word: torch.Tensor
    doubly_stochastic: torch.Tensor  # sum_i (1 - sum_t alpha_ti)^2, per caption
    attention_entropy: torch.Tensor  # H(alpha_t) / log P, per word: 1 for uniform attention, 0 for one cell


def caption_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    alphas: torch.Tensor,
    alpha_c: float = 1.0,
    pad_index: int = 0,
    sync_free: bool = False,
    attention_entropy_penalty: float = 0.0,
) -> Loss:
    """The paper's objective (eq. 14), averaged over the batch:

        L = -log P(y | x) + alpha_c * sum_i (1 - sum_t alpha_ti)^2 [+ w * sum_t H(alpha_t) / log P]

    Args:
        logits: (B,T,V) predictions of `targets`.
        targets: (B,T) word ids, `pad_index` after each caption's <end>.
        alphas: (B,T,P) attention weights.
        alpha_c: lambda, the weight of the doubly stochastic term.
        attention_entropy_penalty: w, the weight of a penalty on each word's attention entropy (normalised by the
            uniform's, log P; summed over the caption's words, as the log-likelihood is). Not in the paper, which has
            no term for how peaked a word's attention is: 0 leaves its objective.
        sync_free: the cross-entropy of every position, padding ignored, rather than of the real words gathered first
            (`logits[mask]`, whose shape depends on the data: a host sync). The same sum; the gather is faster on a
            CPU, where the padded positions' softmax would be computed for nothing.

    Padded steps count in no part, whatever their logits or alphas hold.
    """
    mask = targets != pad_index  # (B,T)
    B = targets.size(0)
    if sync_free:
        V = logits.size(-1)
        nll = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=pad_index, reduction="sum")
    else:
        nll = F.cross_entropy(logits[mask], targets[mask], reduction="sum")  # over real words only
    attention_total = (alphas * mask.unsqueeze(-1)).sum(dim=1)  # (B,P): sum_t alpha_ti over real steps
    doubly_stochastic = ((1.0 - attention_total) ** 2).sum(dim=1).mean()
    P = alphas.size(-1)
    entropy = -(alphas * alphas.clamp_min(1e-12).log()).sum(-1) / (math.log(P) if P > 1 else 1.0)  # (B,T)
    entropy = (entropy * mask).sum()  # over real steps
    loss = nll / B + alpha_c * doubly_stochastic
    if attention_entropy_penalty:
        loss = loss + attention_entropy_penalty * entropy / B
    return Loss(loss, nll / mask.sum(), doubly_stochastic, entropy.detach() / mask.sum())


def hard_attention_terms(
    log_likelihood: torch.Tensor,
    alphas: torch.Tensor,
    locations: torch.Tensor,
    mask: torch.Tensor,
    baseline: torch.Tensor | float,
    reinforce_weight: float,
    reinforce_entropy_weight: float,
) -> torch.Tensor:
    """What hard attention adds to the loss (§4.1, eq. 12), averaged over the batch like the log-likelihood:

        - lambda_r (log p(y|s,a) - b) log p(s|a) - lambda_e H[s]

    Its gradient is the paper's REINFORCE estimate with a baseline b: the minus log-likelihood's own gradient (in
    `caption_loss`) is the first term of eq. 12, and (log p(y|s,a) - b) is held constant.

    Args:
        log_likelihood: (B,) log p(y|s,a) of each caption, its words summed, under the sampled locations.
        alphas: (B,T,P) the attention weights the locations were sampled from.
        locations: (B,T) the sampled s_t.
        mask: (B,T) the real words.
        baseline: b, the running average of log p(y|s,a).
    """
    log_p_s = torch.log(alphas.gather(-1, locations.unsqueeze(-1)).squeeze(-1).clamp_min(1e-12))  # (B,T)
    entropy = -(alphas * alphas.clamp_min(1e-12).log()).sum(-1)  # (B,T): H of each step's Multinoulli(alpha_t)
    advantage = (log_likelihood - baseline).detach()  # (B,)
    per_caption = reinforce_weight * advantage * (log_p_s * mask).sum(1) + reinforce_entropy_weight * (
        entropy * mask
    ).sum(1)
    return -per_caption.mean()


class ShowAttendTell(nn.Module):
    """Image -> caption with soft or hard attention (Xu et al. 2015).

    Args:
        vocab_size: V, the special tokens included.
        backbone: the encoder's network: a name in `captioner.models.encoder.BACKBONES`, or any timm model name (a
            convolutional network's last feature map, a vision transformer's patch grid), see `Encoder`.
        pretrained: load the backbone's ImageNet weights.
        backbone_weights: a timm backbone's pretrained weights from a local file (safetensors or a state_dict): for
            machines without the Hugging Face hub.
        grid_size: pool the feature map to grid_size x grid_size annotations (None: the backbone's own grid).
        image_size: input side in pixels (None: the backbone's default).
        feature_stride: 32 (the backbone's last feature map) or 16 (a 14x14 grid at 224 pixels), see `Encoder`.
        alpha_c: lambda, the weight of the doubly stochastic attention term in the loss (the paper uses 1).
        attention_entropy_penalty: the weight of a penalty on each word's attention entropy (`caption_loss`). Not in
            the paper: 0 (the default) leaves its loss as it is.
        attention_mode: "soft" (deterministic, §4.2) or "hard" (stochastic, §4.1): in training each word attends to
            one location s_t ~ Multinoulli(alpha_t), learnt with REINFORCE (`hard_attention_terms`). Captioning (and
            validation) then uses the expected context, as the paper's code does at test time (capgen.py's sampler
            with sampling=False): hard and soft models caption the same way.
        reinforce_weight: lambda_r of hard attention. The paper gives no value; its code's 1/10, on a cost averaged
            over time steps and summed over a batch of 16, is about 0.1 on the summed log-likelihood used here.
        reinforce_entropy_weight: lambda_e of hard attention, the weight of the entropy H[s] of each word's Multinoulli,
            which it rewards (the paper's code: 0.002, which it sums over its batch where this averages). Not
            `attention_entropy_penalty`, which penalises soft attention's entropy.
        expected_context_p: hard attention, the probability that a training batch uses the expected context instead
            of sampled locations (the paper's variance reduction: 0.5).
        pad_index, start_index, end_index: the special token ids (see `Vocabulary`).
        **decoder_options: the decoder's sizes and choices, see `AttentionDecoder`.
    """

    def __init__(
        self,
        vocab_size: int,
        backbone: str = "efficientnet_lite0",
        pretrained: bool = True,
        grid_size: int | None = None,
        image_size: int | None = None,
        feature_stride: Literal[32, 16] = 32,
        backbone_weights: str | None = None,
        alpha_c: float = 1.0,
        attention_entropy_penalty: float = 0.0,
        attention_mode: Literal["soft", "hard"] = "soft",
        reinforce_weight: float = 0.1,
        reinforce_entropy_weight: float = 0.002,
        expected_context_p: float = 0.5,
        pad_index: int = 0,
        start_index: int = 1,
        end_index: int = 2,
        **decoder_options,
    ):
        super().__init__()
        if alpha_c < 0:
            raise ConfigError(f"alpha_c (lambda) must be >= 0, got {alpha_c}")
        if attention_entropy_penalty < 0:
            raise ConfigError(f"attention_entropy_penalty must be >= 0, got {attention_entropy_penalty}")
        if attention_mode not in ("soft", "hard"):
            raise ConfigError(f"attention_mode must be 'soft' or 'hard', got {attention_mode!r}")
        if not 0 <= expected_context_p <= 1:
            raise ConfigError(f"expected_context_p must be in [0, 1], got {expected_context_p}")
        self.encoder = Encoder(backbone, pretrained, grid_size, image_size, feature_stride, backbone_weights)
        self.decoder = AttentionDecoder(
            vocab_size, self.encoder.out_dim, self.encoder.num_pixels, pad_index=pad_index, **decoder_options
        )
        self.alpha_c, self.attention_entropy_penalty = alpha_c, attention_entropy_penalty
        self.attention_mode, self.expected_context_p = attention_mode, expected_context_p
        self.reinforce_weight, self.reinforce_entropy_weight = reinforce_weight, reinforce_entropy_weight
        if attention_mode == "hard":  # b, the running average of log p(y|s,a): saved in checkpoints
            self.register_buffer("reward_baseline", torch.zeros(()))
        self.pad_index, self.start_index, self.end_index = pad_index, start_index, end_index
        self.fixed_shape = False  # the shrinking batch (the CPU's path); see `forward` and `compile_training_step`

    def annotate(self, images: torch.Tensor | None = None, annotations: torch.Tensor | None = None) -> torch.Tensor:
        """Annotations (B,P,E): given (from the feature cache, say), or encoded from images (B,3,H,W)."""
        if (images is None) == (annotations is None):
            raise ValueError("pass exactly one of images or annotations")
        return self.encoder(images) if annotations is None else annotations.float()

    def forward(
        self,
        captions: torch.Tensor,
        lengths: torch.Tensor,
        images: torch.Tensor | None = None,
        annotations: torch.Tensor | None = None,
        captions_per_image: int = 1,
    ) -> Loss:
        """Teacher forcing on captions (B,T) of lengths (B,), <start> and <end> included -> the loss. With
        `captions_per_image` k, the images (or annotations) are B/k, and captions k*i to k*i+k-1 are image i's: each
        image is encoded once, and (with `fixed_shape`) its keys projected once and attended by its k captions.

        Runs the decoder's shrinking batch, or with `fixed_shape` its fixed shapes (`AttentionDecoder.forward`) on
        captions padded to `bucket_steps`, compiled when `compile_training_step` was called. Both give the same loss.
        """
        annotations = self.annotate(images, annotations)
        hard_training = self.training and self.attention_mode == "hard"
        # The paper's 50% expected-context batches: decided on the host, so a compiled step has two graphs
        sample = hard_training and bool(torch.rand(()) >= self.expected_context_p)
        if self.fixed_shape:
            captions = pad_to_bucket(captions, self.pad_index)
        # b as a copy: the step may keep it for its backward pass, and update_baseline changes b before that runs
        baseline = self.reward_baseline.clone() if sample else None
        loss, log_likelihood = self._teacher_forced_loss(
            annotations, captions, lengths, sample, None, baseline, captions_per_image
        )
        if hard_training:
            self.update_baseline(log_likelihood)
        return loss

    def teacher_forced_loss(
        self,
        annotations: torch.Tensor,
        captions: torch.Tensor,
        lengths: torch.Tensor,
        sample: bool = False,
        locations: torch.Tensor | None = None,
        baseline: torch.Tensor | None = None,
        captions_per_image: int = 1,
    ) -> tuple[Loss, torch.Tensor | None]:
        """The loss of captions (B,T) on annotations (B/k,P,E) (k: `captions_per_image`), by the shrinking or
        (`fixed_shape`) the fixed-shape decoder; with `sample` (hard attention), also log p(y|s,a) (B,) for the
        baseline b, which this leaves as it is. `locations` (B,T-1) are taken as sampled instead of drawing them
        (tests); `baseline` is b (by default the model's `reward_baseline`)."""
        k = captions_per_image
        if self.fixed_shape:  # no host sync, one shape per (B,T); each image's keys once, for its k captions
            logits, alphas, *drawn = self.decoder(annotations, captions, None, sample, locations, k)
        else:  # the shrinking batch sorts the captions by length, mixing images: (B/k,P,E) -> (B,P,E), a row each
            if k > 1:
                annotations = annotations.repeat_interleave(k, dim=0, output_size=captions.size(0))
            logits, alphas, *drawn = self.decoder(annotations, captions, lengths, sample, locations)
        targets = captions[:, 1 : 1 + logits.size(1)]  # (B,T-1)
        loss = caption_loss(
            logits, targets, alphas, self.alpha_c, self.pad_index, self.fixed_shape, self.attention_entropy_penalty
        )
        if not sample:
            return loss, None
        mask = targets != self.pad_index
        per_word = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=self.pad_index, reduction="none")
        log_likelihood = -per_word.sum(1)  # (B,) log p(y|s,a), real words only
        baseline = self.reward_baseline if baseline is None else baseline
        extra = hard_attention_terms(
            log_likelihood, alphas, drawn[0], mask, baseline, self.reinforce_weight, self.reinforce_entropy_weight
        )
        # A new Loss rather than loss._replace, which Dynamo (torch 2.11) cannot trace
        return Loss(loss.loss + extra, *loss[1:]), log_likelihood.detach()

    def compile_training_step(self, **options) -> ShowAttendTell:
        """Train with the fixed-shape step compiled by `torch.compile(**options)` (the `compile` option of
        `CaptioningModule`: on CUDA, mode="reduce-overhead", which captures it as CUDA graphs). The compiled function
        is the loss, forward and backward; the optimizer, clipping and precision stay the trainer's. A step length
        not seen before compiles once more (`bucket_steps` keeps them few). Its outputs, the loss's parts, are
        copies (`compile_function`): they are logged and read after the next step's replay. Not in the paper; it
        changes no result. Returns the model; `fixed_shape = False` goes back to the shrinking batch."""
        self.fixed_shape = True
        self.__dict__["_compiled_loss"] = compile_function(self.teacher_forced_loss, **options)
        return self

    def _teacher_forced_loss(self, *args) -> tuple[Loss, torch.Tensor | None]:
        """The compiled step in training; validation's loss, one forward per batch, runs uncompiled (the same
        function, and no graphs to compile for eval mode)."""
        compiled = self.__dict__.get("_compiled_loss")
        if compiled is None or not self.fixed_shape or not self.training:
            return self.teacher_forced_loss(*args)
        return compiled(*args)

    @torch.no_grad()
    def update_baseline(self, log_likelihood: torch.Tensor | None) -> None:
        """Hard attention's b <- 0.9 b + 0.1 mean log p(y|s,a) (§4.1), the mean over the captions (B,) of a batch
        trained with sampled locations; None for a batch that sampled none, which leaves b as it is.

        Under DDP the mean is over every process's captions: each one's sum and count are all-reduced, so every
        process holds the same b (DDP's broadcast of rank 0's buffers would otherwise drop the others' batches). So
        every process calls this at every hard-attention training step, with None where it sampled nothing.
        """
        b = self.reward_baseline
        stats = torch.zeros(2, device=b.device)  # sum of log p(y|s,a), number of captions
        if log_likelihood is not None:
            stats[0], stats[1] = log_likelihood.sum(), log_likelihood.numel()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # models/ imports no further
            dist.all_reduce(stats)
        total, count = stats
        b.copy_(torch.where(count > 0, 0.9 * b + 0.1 * total / count.clamp_min(1), b))  # no host sync

    def sample(self, annotations: torch.Tensor, samples: int, max_len: int = 30) -> Samples:
        """`samples` captions per image drawn from the model (differentiable log-probabilities, see `Samples`)."""
        special = {"start_index": self.start_index, "end_index": self.end_index, "pad_index": self.pad_index}
        return sample_captions(self.decoder, annotations, samples, max_len=max_len, **special)

    @torch.no_grad()
    def generate(
        self,
        images: torch.Tensor | None = None,
        annotations: torch.Tensor | None = None,
        beam_size: int = 1,
        max_len: int = 30,
        length_penalty: float = LENGTH_PENALTY,
        sync_free: bool | None = None,
        check_every: int | None = None,
    ) -> Generation:
        """Caption a batch: greedy when beam_size is 1, else batched beam search (`captioner.models.decoding`).
        `sync_free`: fixed shapes, no device-to-host copy at every word (by default on CUDA and with a compiled
        decoder), which reads whether every caption has ended once every `check_every` words; the same captions.

        Returns tokens (B,T), lengths (B,), scores (B,) and the per-word alphas (B,T,P).
        """
        annotations = self.annotate(images, annotations)
        special = {"start_index": self.start_index, "end_index": self.end_index, "pad_index": self.pad_index}
        options = {"max_len": max_len, "sync_free": sync_free, "check_every": check_every, **special}
        if beam_size == 1:
            return greedy_search(self.decoder, annotations, **options)
        return beam_search(self.decoder, annotations, beam_size=beam_size, length_penalty=length_penalty, **options)
