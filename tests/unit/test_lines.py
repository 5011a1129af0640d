"""The one line splitter (protocol/lines.py) that logs' tails, the tabs and the text display share."""

from air_magic.protocol.lines import LineSplitter, visible


def test_chunks_split_anywhere_become_whole_lines():
    split = LineSplitter()
    assert split.feed("ep") == []
    assert split.feed("och 1\nepoch") == ["epoch 1"]
    assert split.feed(" 2\n\n") == ["epoch 2", ""]
    assert split.flush() == "" and split.rest() == ""


def test_a_bar_redrawn_without_newline_keeps_only_its_last_state():
    split = LineSplitter()
    for percent in range(0, 101):
        assert split.feed(f"\r{percent:3d}%|{'#' * (percent // 10)}") == []
    assert visible(split.rest()) == "100%|##########"
    assert len(split.rest()) < 20  # a redraw overwrote everything before it
    assert [visible(line) for line in split.feed("\n")] == ["100%|##########"]


def test_a_trailing_carriage_return_erases_nothing():
    split = LineSplitter()
    assert split.feed("windows line\r") == []
    assert [visible(line) for line in split.feed("\n")] == ["windows line"]


def test_an_endless_line_is_handed_back_in_bounded_pieces():
    split = LineSplitter(max_partial=10)
    assert split.feed("x" * 25) == ["x" * 25]
    assert split.rest() == ""
    assert split.feed("abc") == [] and split.flush() == "abc"


def test_feed_block_gives_what_feed_gives_for_any_chunking():
    import random

    rng = random.Random(7)
    alphabet = ["a", "b", "\n", "\r", "é", "xyz"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        by_line, by_block = LineSplitter(max_partial=8), LineSplitter(max_partial=8)
        for chunk in chunks:
            lines = by_line.feed(chunk)
            block = by_block.feed_block(chunk)
            assert block == ("\n".join(lines) if lines else None), (chunks, chunk)
            assert by_block.rest() == by_line.rest()
