"""Results: what normscope measured and decided, as data that renders, serialises and loads back.

Every JSON document normscope writes carries a ``schema`` field; :func:`normscope.load` (:mod:`normscope.documents`)
reads any of them back into its result type by that field.
"""

