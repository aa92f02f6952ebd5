"""Hard (stochastic) attention, §4.1: the sampled context, the REINFORCE estimator, and the model's training switch."""

import pytest
import torch
from torch import nn

from captioner.models.decoder import AttentionDecoder
from captioner.models.show_attend_tell import ShowAttendTell, hard_attention_terms

B, P, E = 3, 9, 16


class FixedScores(nn.Module):
    """A scorer whose attention is all on one location per image (scores 0 elsewhere, 1e4 there)."""

    def __init__(self, targets: list[int]):
        super().__init__()
        self.targets = targets

    def project(self, annotations):
        return annotations

    def forward(self, keys, h):
        scores = torch.zeros(h.size(0), h.size(1), keys.size(1))
        for b, k in enumerate(self.targets):
            scores[b, :, k] = 1e4
        return scores


@pytest.mark.parametrize("position_embedding", [False, True])
def test_a_one_hot_alpha_gives_the_same_context_in_both_modes(position_embedding):
    decoder = AttentionDecoder(20, E, P, embed_dim=8, decoder_dim=12, position_embedding=position_embedding)
    decoder.attention = FixedScores([4, 0, 8])
    a, h = torch.randn(B, P, E), torch.randn(B, 12)
    soft, soft_alpha = decoder.attend(h, a, a)
    hard, hard_alpha, location = decoder.attend(h, a, a, sample=True)
    assert location.tolist() == [4, 0, 8]
    assert torch.equal(soft_alpha, hard_alpha) and torch.allclose(soft, hard, atol=1e-6)


def test_sampled_locations_follow_alpha():
    decoder = AttentionDecoder(20, E, P, embed_dim=8, decoder_dim=12, gate="none")
    a = torch.randn(1, P, E)
    h = torch.randn(1, 12).expand(4000, 12)
    a_many = a.expand(4000, P, E)
    keys = decoder.prepare(a_many)
    with torch.no_grad():
        context, alpha, location = decoder.attend(h, a_many, keys, sample=True)
    frequency = torch.bincount(location, minlength=P).float() / len(location)
    assert torch.allclose(frequency, alpha[0], atol=4 * (0.25 / 4000) ** 0.5)  # within 4 standard errors
    assert torch.allclose(context, a_many[torch.arange(4000), location])  # the context is the sampled a_s


def test_the_estimator_is_unbiased_for_the_exact_gradient():
    """A tiny problem with an exact answer: one image, P = 4 locations with scores theta (alpha = softmax theta), and
    log p(y|s) = w_s. The objective E_s[w_s] + lambda_e H[alpha] has an exact gradient; the mean over many samples of
    the gradient of the hard-attention loss (its minus sign undone) must match it within sampling error."""
    torch.manual_seed(0)
    n, lambda_e, baseline = 50_000, 0.05, 0.3
    theta = torch.tensor([0.5, -1.0, 0.2, 1.0], requires_grad=True)
    w = torch.tensor([-2.0, -0.5, -1.5, -0.2], requires_grad=True)

    alpha = torch.softmax(theta, 0)
    exact = torch.autograd.grad((alpha * w).sum() - lambda_e * (alpha * alpha.log()).sum(), [theta, w])

    alphas = torch.softmax(theta, 0).expand(n, 1, 4)  # (N,T=1,P)
    locations = torch.multinomial(alphas[:, 0].detach(), 1)  # (N,1)
    log_likelihood = w[locations[:, 0]]  # (N,)
    mask = torch.ones(n, 1, dtype=torch.bool)
    loss = -log_likelihood.mean() + hard_attention_terms(
        log_likelihood, alphas, locations, mask, baseline, reinforce_weight=1.0, reinforce_entropy_weight=lambda_e
    )
    estimate = torch.autograd.grad(-loss, [theta, w])

    # the standard error of the theta part: per sample, (w_s - b)(e_s - alpha)
    one_hot = torch.nn.functional.one_hot(locations[:, 0], 4).float()
    per_sample = (log_likelihood.detach() - baseline).unsqueeze(1) * (one_hot - alpha.detach())
    error = 4 * per_sample.std(0) / n**0.5
    assert ((estimate[0] - exact[0]).abs() < error).all(), (estimate[0], exact[0], error)
    assert torch.allclose(estimate[1], exact[1], atol=4 * (0.25 / n) ** 0.5)  # d/dw: the sampled frequencies
    assert not torch.allclose(estimate[0], torch.zeros(4), atol=1e-3)  # the estimator reaches the scores


def model(mode: str, **options) -> ShowAttendTell:
    return ShowAttendTell(
        20, pretrained=False, attention_mode=mode, embed_dim=8, decoder_dim=12, attention_dim=10, **options
    )


def captions():
    lengths = torch.tensor([5, 7, 3])
    tokens = torch.randint(4, 20, (3, 8))
    for i, n in enumerate(lengths):
        tokens[i, 0], tokens[i, n - 1], tokens[i, n:] = 1, 2, 0
    return tokens, lengths


def test_hard_training_samples_half_of_the_batches_and_moves_the_baseline():
    torch.manual_seed(0)
    hard = model("hard").train()
    a = torch.randn(3, hard.encoder.num_pixels, hard.encoder.out_dim)
    tokens, lengths = captions()
    sampled = 0
    for _ in range(40):
        before = hard.reward_baseline.clone()
        hard(tokens, lengths, annotations=a).loss.backward()
        sampled += not torch.equal(before, hard.reward_baseline)
    assert 10 <= sampled <= 30  # expected_context_p = 0.5
    assert hard.reward_baseline < 0  # a running average of log-likelihoods
    assert "reward_baseline" in hard.state_dict() and "reward_baseline" not in model("soft").state_dict()


def test_the_baseline_is_the_papers_moving_average_of_sampled_log_likelihoods():
    """b <- 0.9 b + 0.1 mean log p(y|s,a) after each sampled batch (§4.1); an expected-context batch leaves it."""
    torch.manual_seed(0)
    hard = model("hard", expected_context_p=0.0).train()
    a = torch.randn(3, hard.encoder.num_pixels, hard.encoder.out_dim)
    tokens, lengths = captions()
    expected = 0.0
    for step in range(3):
        torch.manual_seed(step)  # the forward's draws, made here first: its coin (sample or not), then the locations
        torch.rand(())
        logits, _, _ = hard.decoder(a, tokens, lengths, sample=True)
        targets = tokens[:, 1 : 1 + logits.size(1)]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=0, reduction="sum")
        log_likelihood = -nll / 3  # the mean over the 3 captions of their summed log-probabilities
        expected = 0.9 * expected + 0.1 * log_likelihood.item()
        torch.manual_seed(step)
        hard(tokens, lengths, annotations=a)
        assert hard.reward_baseline.item() == pytest.approx(expected, rel=1e-5)
    hard.expected_context_p = 1.0
    hard(tokens, lengths, annotations=a)
    assert hard.reward_baseline.item() == pytest.approx(expected, rel=1e-5)


def _update_baselines_on_two_ranks(rank: int, port: int, folder: str) -> None:
    """One DDP process: rank 0 sampled 2 captions, rank 1 sampled 3 then nothing (an expected-context batch)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    hard = model("hard")
    batches = [[torch.tensor([-1.0, -2.0]), torch.tensor([-4.0, -6.0])], [torch.tensor([-3.0, -4.0, -5.0]), None]]
    for log_likelihood in batches[rank]:
        hard.update_baseline(log_likelihood)
    torch.save(hard.reward_baseline, f"{folder}/{rank}.pt")
    dist.destroy_process_group()


def test_under_ddp_every_rank_ends_with_the_baseline_of_one_process_on_all_the_data(tmp_path):
    """DDP broadcasts rank 0's buffers: b must be averaged over every rank's captions, or the others' are lost."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_update_baselines_on_two_ranks, args=(port, str(tmp_path)), nprocs=2)
    single = model("hard")
    single.update_baseline(torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0]))  # both ranks' first batch: mean -3
    single.update_baseline(torch.tensor([-4.0, -6.0]))  # rank 0's second batch alone: mean -5
    ranks = [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]
    assert ranks[0].item() == ranks[1].item() == pytest.approx(single.reward_baseline.item())
    assert single.reward_baseline.item() == pytest.approx(0.9 * (0.1 * -3.0) + 0.1 * -5.0)


def test_hard_evaluation_is_the_expected_context():
    """At test time (eval mode) a hard model decodes with the expected context: it is the soft model's forward."""
    torch.manual_seed(0)
    hard = model("hard", expected_context_p=0.0).eval()
    soft = model("soft").eval()
    soft.load_state_dict({k: v for k, v in hard.state_dict().items() if k != "reward_baseline"})
    a = torch.randn(3, hard.encoder.num_pixels, hard.encoder.out_dim)
    tokens, lengths = captions()
    assert torch.equal(hard(tokens, lengths, annotations=a).loss, soft(tokens, lengths, annotations=a).loss)
    assert torch.equal(hard.generate(annotations=a).tokens, soft.generate(annotations=a).tokens)


def test_unknown_mode_is_a_config_error():
    from captioner.errors import ConfigError

    with pytest.raises(ConfigError, match="attention_mode"):
        model("sharp")


@pytest.mark.slow
def test_a_hard_fit_on_a_small_shapes_run_learns(tmp_path, monkeypatch):
    """configs/shapes.yaml as shipped, on 400 training images for 3 epochs, with --model.attention_mode=hard: its
    best val/bleu4 is far above the untrained model's (about 75 s on 2 cores)."""
    from captioner.cli import run_lightning_cli
    from tests.conftest import REPO

    monkeypatch.chdir(tmp_path)  # the config's logs and checkpoints land here
    data = ["--data.init_args.train_size=400", "--data.init_args.val_size=50", "--data.init_args.test_size=10"]
    args = ["--config", str(REPO / "configs" / "shapes.yaml"), *data, "--model.attention_mode=hard"]
    untrained = run_lightning_cli(["validate", *args]).trainer.callback_metrics["val/bleu4"].item()
    fit = run_lightning_cli(["fit", *args, "--trainer.max_epochs=3"])
    best = fit.trainer.checkpoint_callback.best_model_score.item()
    assert fit.model.model.attention_mode == "hard"
    assert best > 0.4 and best > untrained + 0.3, (best, untrained)


def test_a_hard_model_trains_through_the_cli_and_loads_for_captioning(tmp_path):
    from captioner.api import Captioner, export
    from captioner.cli import main
    from tests.conftest import tiny_fit_args
    from tests.images import photo

    main(["fit", *tiny_fit_args(tmp_path, "--model.attention_mode=hard", "--model.reinforce_entropy_weight=0.01")])
    checkpoint = tmp_path / "checkpoints" / "best.ckpt"
    state = torch.load(checkpoint, weights_only=True)
    assert state["hyper_parameters"]["attention_mode"] == "hard"
    assert state["state_dict"]["model.reward_baseline"] < 0  # the baseline moved and is saved
    for path in (checkpoint, export(checkpoint, tmp_path / "hard.pt")):
        captioner = Captioner.load(path)
        assert captioner.model.attention_mode == "hard"
        assert captioner.caption(photo("chelsea"))[0].alphas.shape[1] == 49
