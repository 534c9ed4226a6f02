"""The texts several layers give (`core.messages`), on plain Python: counts
in the singular and plural, the epoch-shorter-than-a-window warning, the
float16 warning for weights used twice and the
unexpected-keyword refusal."""

from accum_model.core import messages


def test_counts_read_in_the_singular_for_one():
    assert messages.counted(1, "micro-batch") == "1 micro-batch"
    assert messages.counted(3, "micro-batch") == "3 micro-batches"
    assert messages.counted(0, "window") == "0 windows"


def test_an_epoch_shorter_than_a_window_names_its_three_fixes():
    text = messages.windows_cut_by_epoch(4, 100)
    assert text.startswith("Each epoch has 4 micro-batches, fewer than a "
                           "window (n_gradients=100)")
    for fix in ("n_gradients <= 4", "steps_per_epoch",
                "flush_each_epoch=False"):
        assert fix in text


def test_an_unexpected_keyword_names_the_closest_known_one():
    known = ("n_gradients", "flush_each_epoch")
    text = messages.unexpected_keyword("accumulating", "n_gradient", 4,
                                       known, listed=True)
    assert text == ("accumulating() got an unexpected keyword argument "
                    "'n_gradient'. Did you mean `n_gradients`? It takes "
                    "n_gradients, flush_each_epoch. Received: n_gradient=4")
    assert "Did you mean" not in messages.unexpected_keyword(
        "Net", "colour", 1, known)


def test_weights_used_twice_under_loss_scaling_are_named_with_what_is_exact():
    text = messages.float16_check_of_reused_weights(["shared", "gru"])
    assert text.startswith("Layers ['shared', 'gru'] use their weights more "
                           "than once in a step")
    for exact in ("dtype='float32'", "'mixed_bfloat16'"):
        assert exact in text
