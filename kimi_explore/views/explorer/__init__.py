"""The interactive Explorer: plotly.js views in anywidgets, stepped from a Session."""
