"""The troubleshooting page quotes messages the code still prints (docs/troubleshooting.md).

Every ```text block after ``<!-- message -->`` is checked against the message templates of the package's source
(tests/docs/message_templates.py). A block marked ``<!-- message: ID -->`` is also produced for real, by the
trigger of that ID below, and compared with the page's text as an expected-output block is
(tests/docs/expected_output.py): the cheap ones in process, the shard ones on a tiny shard set (slow).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.docs.expected_output import match_output
from tests.docs.message_templates import ROOT, Matcher, Quote, Template, message_lines, page_quotes

if TYPE_CHECKING:
    import torch

PAGE = ROOT / "docs" / "troubleshooting.md"


@pytest.fixture(scope="module")
def matcher() -> Matcher:
    return Matcher()


def page() -> list[Quote]:
    quotes, problems = page_quotes(PAGE.read_text(encoding="utf-8"))
    assert not problems, "\n".join(f"docs/troubleshooting.md {p}" for p in problems)
    return quotes


def unexplained(text: str, matcher: Matcher, name: str = "docs/troubleshooting.md") -> list[str]:
    """One line per quoted line of ``text`` that is not one of the package's messages."""
    quotes, problems = page_quotes(text)
    failures = [f"{name} {p}" for p in problems]
    for quote in quotes:
        for offset, line in enumerate(quote.text.splitlines()):
            if line.strip() in ("", "..."):
                continue
            found = matcher.explain(line)
            if not found.holds:
                failures.append(
                    f"{name}:{quote.line + offset}: no message of ddp_rank prints this line (templates explain "
                    f"{found.share:.0%}; left over: {found.unexplained[:120]!r}); quote what the code prints "
                    f"now, `...` for what varies: {line[:160]}"
                )
    return failures


def test_the_page_quotes_messages() -> None:
    quotes = page()
    assert len(quotes) >= 20
    assert all(message_lines(q.text) for q in quotes), "an empty <!-- message --> block"


@pytest.mark.slow  # reads the package's source: seconds
def test_every_quoted_message_is_one_the_code_prints(matcher: Matcher) -> None:
    failures = unexplained(PAGE.read_text(encoding="utf-8"), matcher)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_a_quote_the_code_no_longer_prints_fails(matcher: Matcher) -> None:
    """The check has teeth: one changed word in a quote of a scratch copy, or a made-up message, fails it."""
    text = PAGE.read_text(encoding="utf-8")
    for old, new in [
        ("it is recorded in the manifest", "it is written in the manifest"),
        ("cannot compute the batch statistics", "cannot compute the statistics"),
        ("resume with the same global batch or start afresh", "resume with the same batch or start afresh"),
        ("valid keys of 'data'", "known keys of 'data'"),
    ]:
        assert old in text, old
        changed = text.replace(old, new, 1)
        assert unexplained(changed, matcher), f"a quote with {new!r} passed"
    made_up = (
        text + "\n<!-- message -->\n```text\nddp-rank train: error: the shards are too shiny to read\n```\n"
    )
    assert unexplained(made_up, matcher)


@pytest.mark.slow
def test_a_message_the_code_no_longer_prints_fails_its_quote(matcher: Matcher) -> None:
    """The other way round: the code's message changes (here in the templates, as an edit of the source would
    change them) and the page's unchanged quote fails."""
    old, new = "it is recorded in the manifest", "the manifest records it"

    def edit(template: Template) -> Template:
        text = "".join("\0" if t is None else t for t in template.tokens).replace(old, new)
        return Template(tuple(None if c == "\0" else c for c in text), template.where)

    edited = [edit(template) for template in matcher.templates]
    assert edited != list(matcher.templates)
    assert not unexplained(PAGE.read_text(encoding="utf-8"), matcher)
    failures = unexplained(PAGE.read_text(encoding="utf-8"), Matcher(edited))
    assert len(failures) == 1 and "--shared-classes needs a reason" in failures[0]


def test_markers_are_checked() -> None:
    _, problems = page_quotes("<!-- message -->\n\n```text\nx\n```\n<!-- message: a b -->\n")
    assert len(problems) == 2


# ---------------------------------------------------------------------------------------------------------------
# Messages produced for real


def _config_unknown_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    from ddp_rank.config import ConfigError, load_config
    from ddp_rank.runtime.failure import report_agreed_error

    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "my.yaml").write_text("data:\n  global_bach_size: 64\n")
    with pytest.raises(ConfigError) as caught:
        load_config("configs/my.yaml")
    report_agreed_error("ddp-rank train", caught.value)
    return capsys.readouterr().err


def _verify_no_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    from ddp_rank.cli import main

    (tmp_path / "runs" / "nowhere").mkdir(parents=True)
    assert main(["shards", "verify", "runs/nowhere"]) != 0
    return capsys.readouterr().err


def _shared_classes_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    from ddp_rank.cli import main

    _write_images(tmp_path / "images")
    assert main(["shards", "build", "images", "out", "--shared-classes", " ", "--no-progress"]) != 0
    return capsys.readouterr().err


def _batchnorm_model() -> torch.nn.Module:
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(12, 8)
            self.bn = torch.nn.BatchNorm1d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.fc(x))

    return Net()


def _refused_step(model: torch.nn.Module, chunk_size: int) -> str:
    import torch

    from ddp_rank.train import PlainBackend, forward_backward

    def loss_fn(embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return embeddings.square().mean()

    with pytest.raises(ValueError) as caught:
        forward_backward(
            PlainBackend(model), torch.randn(12, 12), torch.zeros(12), loss_fn, chunk_size=chunk_size
        )
    return f"{type(caught.value).__name__}: {caught.value}"


def _batchnorm_chunked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    return _refused_step(_batchnorm_model().train(), 4)


def _ghost_groups_cut(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    from ddp_rank.train import convert_to_ghost

    return _refused_step(convert_to_ghost(_batchnorm_model(), 4).train(), 6)


def _write_images(folder: Path) -> None:
    """Two categories of four classes, three 16 px images each: the smallest set `shards build` splits."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for category in ["mugs", "lamps"]:
        for product in range(4):
            where = folder / category / f"{category}-{product}"
            where.mkdir(parents=True, exist_ok=True)
            for view in range(3):
                pixels = rng.integers(0, 255, size=(16, 16, 3)).astype(np.uint8)
                Image.fromarray(pixels).save(where / f"{view}.jpg")


def _damaged_shards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: Callable[[Path], None]
) -> str:
    from ddp_rank.cli import main

    _write_images(tmp_path / "images")
    assert main(["shards", "build", "images", "built", "--test-fraction", "0.5", "--no-progress"]) == 0
    shutil.copytree(tmp_path / "built", tmp_path / "sop-shards")
    damage(tmp_path / "sop-shards" / "train" / "train-c0000-00000.tar")
    capsys.readouterr()
    assert main(["shards", "verify", "sop-shards"]) != 0
    captured = capsys.readouterr()
    return captured.out + captured.err


def _verify_truncated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    def cut(shard: Path) -> None:
        data = shard.read_bytes()
        shard.write_bytes(data[:-600])

    return _damaged_shards(tmp_path, capsys, cut)


def _verify_corrupt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    def flip(shard: Path) -> None:
        data = bytearray(shard.read_bytes())
        data[1200] ^= 0xFF  # inside the first class's image bytes
        shard.write_bytes(bytes(data))

    return _damaged_shards(tmp_path, capsys, flip)


Trigger = Callable[[Path, pytest.CaptureFixture[str]], str]
TRIGGERS: dict[str, Trigger] = {
    "config-unknown-key": _config_unknown_key,
    "verify-no-manifest": _verify_no_manifest,
    "shared-classes-reason": _shared_classes_reason,
    "batchnorm-chunked": _batchnorm_chunked,
    "ghost-groups-cut": _ghost_groups_cut,
}
SLOW_TRIGGERS: dict[str, Trigger] = {
    "verify-truncated": _verify_truncated,
    "verify-corrupt": _verify_corrupt,
}


def test_every_marked_quote_has_its_trigger() -> None:
    ids = [q.id for q in page() if q.id]
    assert sorted(ids) == sorted(TRIGGERS | SLOW_TRIGGERS), (
        "a <!-- message: ID --> without a trigger, or back"
    )


def _check_trigger(name: str, trigger: Trigger, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)  # rank 0 prints an agreed error at once
    quote = next(q for q in page() if q.id == name)
    output = trigger(tmp_path, capsys)
    mismatch = match_output(quote.text, output)
    assert mismatch is None, f"docs/troubleshooting.md:{quote.line}: {mismatch}\nthe code printed:\n{output}"


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_a_quoted_message_is_what_the_code_prints(name: str, tmp_path: Path, monkeypatch, capsys) -> None:
    _check_trigger(name, TRIGGERS[name], tmp_path, monkeypatch, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_TRIGGERS))
def test_a_quoted_shard_message_is_what_verify_prints(name: str, tmp_path: Path, monkeypatch, capsys) -> None:
    _check_trigger(name, SLOW_TRIGGERS[name], tmp_path, monkeypatch, capsys)
