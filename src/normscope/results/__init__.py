"""Results: what normscope measured and decided, as data that renders, serialises and loads back."""
