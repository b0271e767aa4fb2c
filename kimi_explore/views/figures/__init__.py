"""Static matplotlib figures: pure functions `trace -> Figure`, and the offline HTML report."""
