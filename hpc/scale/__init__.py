"""Scaling studies: one job per node count, one report of what they measured and what the model predicts.

- ``study``: check every point, submit one job per point, follow them;
- ``predict``: the planner's model of one point (also alone: ``hpcx scale predict``);
- ``report``: measured figures, efficiency, prediction and a verdict per point;
- ``output``: the terminal table, CSV, Markdown and PNG.

Nothing here imports torch; matplotlib is imported only when a plot is drawn.
"""

from hpc.scale.output import markdown, notes, plot, table_lines, write_csv, write_report
from hpc.scale.predict import ASSUMED_MFU, Anchor, Prediction, link_label, predict, predict_table, predicted_step
from hpc.scale.report import Study, build_report, measure
from hpc.scale.study import (MODES, STUDY_FILE, follow_study, parse_nodes, point_batch, point_state, prepare_points,
                             read_study, start_study)

__all__ = ["ASSUMED_MFU", "MODES", "STUDY_FILE", "Anchor", "Prediction", "Study", "build_report", "follow_study",
           "link_label", "markdown", "measure", "notes", "parse_nodes", "plot", "point_batch", "point_state",
           "predict", "predict_table", "predicted_step", "prepare_points", "read_study", "start_study",
           "table_lines", "write_csv", "write_report"]
