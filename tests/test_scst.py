"""Self-critical sequence training: the loss and its gradient by hand, the sampler, the baselines, and a run through
the CLI that starts from a cross-entropy checkpoint, resumes, and tests, captions and exports."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from captioner.models.decoding import sample_captions
from captioner.objectives import SelfCritical, self_critical_loss
from tests.helpers import END, PAD, SPECIAL, START, A, B, C, TableDecoder, random_decoder


def test_the_loss_of_fixed_samples_and_rewards_and_its_gradient_by_hand():
    """One image, K = 2 one-word captions drawn from p = softmax(theta) = (1/4, 1/2, 1/4): words 0 and 1, rewards 1
    and 3, and each one's baseline the other's reward. The loss is -1/2 ((1 - 3) log p_0 + (3 - 1) log p_1) =
    log(1/4) - log(1/2) = -ln 2, and its gradient, REINFORCE's, -1/2 sum_k (r_k - b_k) (e_{w_k} - p) = e_0 - e_1."""
    theta = torch.tensor([0.0, math.log(2), 0.0], requires_grad=True)
    log_p = F.log_softmax(theta, dim=0)
    log_probs = torch.stack([log_p[0], log_p[1]]).view(1, 2, 1)  # (B,K,T)
    rewards = torch.tensor([[1.0, 3.0]])
    baselines = SelfCritical([[["a"]]], baseline="others").baselines(rewards)  # the other sample's reward: (3, 1)
    assert baselines.tolist() == [[3.0, 1.0]]
    loss = self_critical_loss(log_probs, torch.ones(1, 2, 1, dtype=torch.bool), rewards, baselines)
    assert loss.item() == pytest.approx(-math.log(2))
    loss.backward()
    assert theta.grad.tolist() == pytest.approx([1.0, -1.0, 0.0])


def test_words_after_the_end_count_in_no_part_of_the_loss():
    log_probs = torch.tensor([[[-1.0, -2.0, -50.0]]], requires_grad=True)  # a caption of two words, then padding
    mask = torch.tensor([[[True, True, False]]])
    loss = self_critical_loss(log_probs, mask, torch.tensor([[2.0]]), torch.tensor([[0.5]]))
    assert loss.item() == pytest.approx(-(2.0 - 0.5) * (-3.0))
    loss.backward()
    assert log_probs.grad.tolist() == [[[-1.5, -1.5, 0.0]]]


def test_the_baselines():
    critic = SelfCritical([[["a", "red", "circle"]]], baseline="others")
    rewards = torch.tensor([[1.0, 3.0, 5.0], [0.0, 0.0, 6.0]])
    assert critic.baselines(rewards).tolist() == [[4.0, 3.0, 2.0], [3.0, 3.0, 0.0]]  # the mean of the other two
    greedy = SelfCritical([[["a", "red", "circle"]]], baseline="greedy")
    assert greedy.baselines(rewards, torch.tensor([2.0, 1.0])).tolist() == [[2.0] * 3, [1.0] * 3]
    assert critic.rewards([[["a", "red", "circle"], ["a"]]], [0]).shape == (1, 2)


def test_samples_follow_the_model_s_distribution_and_carry_its_log_probabilities():
    table = {START: {A: 0.6, B: 0.3, END: 0.1}, A: {END: 1.0}, B: {C: 0.5, END: 0.5}, C: {END: 1.0}}
    torch.manual_seed(0)
    samples = sample_captions(TableDecoder(table), torch.zeros(500, 4, 2), samples=8, max_len=6, **SPECIAL)
    tokens, mask = samples.tokens.view(4000, -1), samples.mask.view(4000, -1)
    first = tokens[:, 0]
    frequencies = [(first == word).float().mean().item() for word in (A, B, END)]
    assert frequencies == pytest.approx([0.6, 0.3, 0.1], abs=4 * (0.25 / 4000) ** 0.5)  # within 4 standard errors
    lengths = mask.sum(1)
    assert (tokens.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1) == END).all()  # each caption ends with <end>
    assert (tokens[~mask] == PAD).all() and (samples.log_probs.view(4000, -1)[~mask] == 0).all()
    expected = {(A, END): math.log(0.6), (B, C, END): math.log(0.15), (B, END): math.log(0.15), (END,): math.log(0.1)}
    for row, log_p in zip(tokens.tolist()[:50], samples.log_probs.view(4000, -1).sum(1).tolist()[:50], strict=True):
        words = tuple(w for w in row if w != PAD)
        assert log_p == pytest.approx(expected[words], abs=1e-5)


def test_a_sample_s_log_probability_reaches_every_decoder_weight():
    decoder = random_decoder().train()
    samples = sample_captions(decoder, torch.randn(3, 9, 16), samples=4, max_len=5, **SPECIAL)
    assert samples.tokens.shape[:2] == (3, 4) and samples.log_probs.requires_grad
    (samples.log_probs * samples.mask).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in decoder.parameters())


def test_an_scst_run_starts_from_a_cross_entropy_checkpoint_resumes_and_tests_captions_and_exports(
    tiny_checkpoint, tmp_path, capsys
):
    from captioner.api import Captioner, export
    from captioner.cli import main, run_lightning_cli
    from tests.conftest import tiny_fit_args
    from tests.images import photo

    start = tiny_checkpoint  # debug.yaml, cross-entropy, one epoch
    scst = ["--model.objective=scst", f"--model.init_from={start}", "--data.init_args.train_captions=random"]
    fit = run_lightning_cli(["fit", *tiny_fit_args(tmp_path, *scst)])
    begun = torch.load(start, map_location="cpu", weights_only=True)["state_dict"]
    ended = fit.trainer.lightning_module.state_dict()
    moved = [k for k, v in begun.items() if not torch.equal(v, ended[k])]
    assert moved and all(k.startswith("model.decoder.") for k in moved)  # it trained from the start's weights
    metrics = fit.trainer.callback_metrics
    assert {"train/reward", "train/baseline", "train/beat_baseline", "val/cider", "val/bleu4"} <= set(metrics)
    assert 0.0 <= float(metrics["train/beat_baseline"]) <= 1.0 and float(metrics["train/reward"]) >= 0.0

    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    again = run_lightning_cli(["fit", *tiny_fit_args(tmp_path, *scst, "--ckpt_path=last")])  # nothing left to train
    restored = again.trainer.lightning_module.state_dict()
    assert all(torch.equal(v, restored[k]) for k, v in last.items())  # the run's own weights, not init_from's
    resumed = run_lightning_cli(["fit", *tiny_fit_args(tmp_path, *scst, "--trainer.max_epochs=2", "--ckpt_path=last")])
    assert resumed.trainer.global_step == 2 * fit.trainer.global_step  # continued, not started again

    checkpoint = tmp_path / "checkpoints" / "best.ckpt"
    tested = run_lightning_cli(["test", *tiny_fit_args(tmp_path, *scst), f"--ckpt_path={checkpoint}"])
    assert math.isfinite(float(tested.trainer.callback_metrics["test/cider"]))
    exported = export(checkpoint, tmp_path / "scst.pt")
    for path in (checkpoint, exported):
        assert Captioner.load(path).caption(photo("coffee"))[0].tokens
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    photo("chelsea").save(pictures / "cat.jpg")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["caption", str(pictures), "--ckpt_path", str(checkpoint)])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith(str(pictures / "cat.jpg"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("--model.embed_dim=16", r"its model does not fit the config's \(size mismatch for decoder\.embedding\.weight"),
        (
            "--data.init_args.train_size=8",
            r"its vocabulary \(\d+ words\) is not the data's \(\d+ words; they part at id",
        ),
        ("--model.attention_mode=hard", r"objective scst needs soft attention"),
    ],
)
def test_a_start_that_does_not_fit_the_config_is_one_line_naming_both(
    tiny_checkpoint, tmp_path, capsys, change, message
):
    from captioner.cli import main
    from tests.conftest import tiny_fit_args

    start = tiny_checkpoint
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *tiny_fit_args(tmp_path, "--model.objective=scst", f"--model.init_from={start}", change)])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith("error: ") and re.search(message, line), line


def test_the_greedy_baseline_is_the_reward_of_the_image_s_greedy_caption_decoded_without_dropout(monkeypatch):
    """Rennie et al.'s baseline (--model.scst_baseline=greedy): each image's K samples are judged against the reward
    of its greedy caption, decoded in eval mode (no dropout), after which the model trains on."""
    from captioner.lit_module import CaptioningModule

    vocab = ["<pad>", "<start>", "<end>", "<unk>", "a", "red", "circle"]
    sizes = {"embed_dim": 8, "decoder_dim": 8, "attention_dim": 8, "pretrained": False, "image_size": 64}
    module = CaptioningModule(vocab, objective="scst", scst_baseline="greedy", scst_samples=3, **sizes).train()
    references = [[["a", "red", "circle"]], [["a", "circle"]]]
    module.objective = SelfCritical(references, module.vocab, samples=3, baseline="greedy")
    generate, modes, logged = module.model.generate, [], {}

    def spy(*args, **kwargs):
        modes.append(module.model.training)
        return generate(*args, **kwargs)

    monkeypatch.setattr(module.model, "generate", spy)
    monkeypatch.setattr(module, "log", lambda name, value, **kwargs: logged.__setitem__(name, float(value)))
    P, E = module.model.encoder.num_pixels, module.model.encoder.out_dim
    batch = {"annotations": torch.randn(2, P, E).relu(), "index": torch.tensor([0, 1])}
    loss = module.training_step(batch, 0)
    loss.backward()
    assert modes == [False] and module.model.training  # decoded in eval mode, then back to training
    module.model.eval()
    greedy = generate(annotations=batch["annotations"], max_len=module.hparams.max_caption_len)
    words = [[vocab_words] for vocab_words in map(module.vocab.decode_tokens, greedy.tokens.tolist())]
    expected = module.objective.rewards(words, [0, 1])[:, 0].mean()
    assert logged["train/baseline"] == pytest.approx(float(expected), abs=1e-6)
    assert torch.isfinite(loss) and module.model.decoder.L_o.weight.grad is not None
