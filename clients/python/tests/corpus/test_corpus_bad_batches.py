"""Corpus: a bad batch inside a run whose loss has heavy tails of its own. The spike
rule must not call the healthy tail a spike (test_corpus_heavy_tails runs the same
regression without the bad batch) and must still name this batch, at its step, with
its cause.
"""

from __future__ import annotations

from corpus_support import described, expects, judge, seeded
from test_corpus_heavy_tails import STEPS, train_boxes

BAD_STEP = 250


@seeded
@expects("loss_spike", "loss", "data_batch", also=["adam_update_spike"])
def test_a_batch_of_invalid_boxes_in_a_heavy_tailed_regression(
    request, gradflow_server, gradflow_env, seed
):
    """The small-batch box regression under heavy-tailed annotation noise, with one
    batch whose boxes are in pixels instead of fractions of the image (invalid
    annotations in the dataset): that step's loss jumps by four orders of magnitude,
    the next is back in the noise ("There may be invalid data in the dataset";
    "check your dataset; there might be some bug samples").

    Threads: https://github.com/eragonruan/text-detection-ctpn/issues/374,
    https://github.com/open-mmlab/mmdetection/issues/2061
    """
    run_id, losses, _, _ = train_boxes(seed, bad_step=BAD_STEP)
    before = sorted(losses[BAD_STEP - 128 : BAD_STEP])
    median = before[len(before) // 2]
    assert losses[BAD_STEP] > 1000 * median, losses[BAD_STEP]
    assert losses[BAD_STEP + 1] < 10 * median, losses[BAD_STEP + 1]  # back in the noise
    stored = gradflow_server.run(run_id)["step_count"]
    assert stored == STEPS, stored
    # The batch also moves Adam's update on the step it is sampled; nothing else speaks.
    alert = judge(request, gradflow_server, run_id)
    assert alert["first_step"] == BAD_STEP, alert["first_step"]
    serious = gradflow_server.serious(run_id)
    spikes = [a["first_step"] for a in serious if a["kind"] == "loss_spike"]
    assert spikes == [BAD_STEP], described(serious)
