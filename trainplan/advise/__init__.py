"""`trainplan advise`: the configurations that fit, searched along the memory ladder, with a step-time estimate.

search.py the ladder and the search, estimate.py the step time and its calibration, command.py the CLI.
"""

from trainplan.advise.estimate import calibration_from_records, records_from_registry

__all__ = ["calibration_from_records", "records_from_registry"]
