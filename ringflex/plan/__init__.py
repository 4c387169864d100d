"""The plan of a call: pure functions of the layout, the shapes and the mask, with no
communication. Which tokens a rank holds (``layout``), which blocks need work and as which
hops (``blocks``), which keys each query row sees (``extents``), and who lends what
(``lending``)."""
