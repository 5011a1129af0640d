"""The per-rank screen model behind the tabs: carriage returns, streams, the cap."""

from __future__ import annotations

from air_magic.display.screen import RankScreen


def test_a_tqdm_style_stream_ends_as_its_final_line():
    screen = RankScreen()
    # tqdm writes "\r" + the whole bar on each update, in arbitrary chunks.
    for chunk in [
        "\r  0%|     | 0/3",
        "\r 33%|#    | 1/3",
        "\r 67%|##",
        "#  | 2/3",
        "\r100%|#####| 3/3",
        "\n",
    ]:
        screen.write("stderr", chunk)
    assert screen.text() == "100%|#####| 3/3\n"
    # Progress, not an error: shown unshaded (as stdout); a stderr line that is not redrawn stays stderr.
    assert screen.stream_outputs() == (
        {"output_type": "stream", "name": "stdout", "text": "100%|#####| 3/3\n"},
    )
    screen.write("stderr", "Traceback (most recent call last):\r\n")  # a CRLF ending is no redraw
    assert screen.stream_outputs()[-1] == {
        "output_type": "stream",
        "name": "stderr",
        "text": "Traceback (most recent call last):\n",
    }


def test_partial_line_is_shown_and_replaced_on_redraw():
    screen = RankScreen()
    screen.write("stdout", "step 1")
    assert screen.text() == "step 1\n"
    screen.write("stdout", "\rstep 2")
    assert screen.text() == "step 2\n"


def test_streams_stay_distinguishable_and_in_order():
    screen = RankScreen()
    screen.write("stdout", "a\nb\n")
    screen.write("stderr", "warning\n")
    screen.write("stdout", "c\n")
    assert [(o["name"], o["text"]) for o in screen.stream_outputs()] == [
        ("stdout", "a\nb\n"),
        ("stderr", "warning\n"),
        ("stdout", "c\n"),
    ]


def test_ansi_colours_are_kept_for_the_frontend():
    screen = RankScreen()
    screen.write("stdout", "\x1b[31mred\x1b[0m\n")
    assert screen.text() == "\x1b[31mred\x1b[0m\n"


def test_the_tail_is_capped_and_counts_what_it_dropped():
    screen = RankScreen(max_lines=10)
    screen.write("stdout", "".join(f"line {i}\n" for i in range(25)))
    assert screen.dropped == 15
    assert screen.text().splitlines() == [f"line {i}" for i in range(15, 25)]


def test_a_huge_line_is_cut_for_display():
    screen = RankScreen()
    screen.write("stdout", "x" * 50_000 + "\n")
    (out,) = screen.stream_outputs()
    assert len(out["text"]) < 11_000 and "more characters in the log" in out["text"]


def test_a_short_tail_says_how_many_earlier_lines_the_log_has():
    screen = RankScreen(max_lines=5)
    screen.write("stdout", "".join(f"line {i}\n" for i in range(10)))
    screen.write("stderr", "Traceback (most recent call last):\nValueError: x\n")
    assert screen.stream_outputs(3) == (
        {"output_type": "stream", "name": "stdout", "text": "… 9 earlier line(s) in the log\nline 9\n"},
        {
            "output_type": "stream",
            "name": "stderr",
            "text": "Traceback (most recent call last):\nValueError: x\n",
        },
    )
