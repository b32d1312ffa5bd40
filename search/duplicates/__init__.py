"""Near-duplicate detection at a calibrated probability: edited copies (edits.py), the duplicate
temperature fitted on them (calibration.py), candidate sets and groups (groups.py), the
`softsearch dedup` job (job.py) and its page (page.py). Imports search.serving (the snapshot it scans)."""
from index.lazy import lazy_exports

__all__ = ["DuplicateCalibration", "calibrate", "edited_copy", "find_duplicates", "mutual_groups"]
__getattr__ = lazy_exports(__name__, {
    "DuplicateCalibration": "search.duplicates.calibration", "calibrate": "search.duplicates.calibration",
    "edited_copy": "search.duplicates.edits", "find_duplicates": "search.duplicates.job",
    "mutual_groups": "search.duplicates.groups"})
