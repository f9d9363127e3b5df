"""A verl-style per-sample reward: does the image hold as many objects of the colour as the row's ground truth says?

omnirl-async calls it once per image, by keyword, as verl calls compute_score:
`solution_image` is uint8 [H, W, 3] RGB, `ground_truth` and `data_source` come from the prompt's row
(here verl's layout, `reward_model.ground_truth`), `extra_info` holds the row's extra_info plus the prompt
and the row's other fields.
"""

import numpy as np
from scipy import ndimage

PALETTE = {"red": (230, 25, 25), "green": (25, 200, 40), "blue": (30, 70, 255), "yellow": (245, 225, 20),
           "purple": (190, 40, 230), "white": (245, 245, 245)}  # the shapes world's colours


def compute_score(data_source, solution_image, ground_truth, extra_info=None):
    target = np.asarray(PALETTE[ground_truth["color"]], dtype=np.float32)
    mask = np.abs(solution_image.astype(np.float32) - target).sum(-1) < 120
    labels, n = ndimage.label(mask)
    sizes = ndimage.sum(mask, labels, range(1, n + 1)) if n else np.zeros(0)
    objects = int((sizes >= 6).sum())  # blobs of at least 6 pixels
    return {"score": float(objects == ground_truth["count"]), "objects": objects}  # verl's dict form: extras logged
