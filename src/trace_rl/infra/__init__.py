"""What every layer leans on and nothing TRACE-specific: the typed config loader and its one-line
errors (`config.py`), a user's code named from a config (`references.py`), live progress bars
(`progress.py`), one HTTP request within a deadline (`http_deadline.py`)."""
