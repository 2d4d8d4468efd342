"""The step graph's vocabulary, shared by capture and the passes: the marker ops that delimit
forward, backward and each parameter's update (``ops``) and the order of the graph's inputs and
outputs (``layout``)."""
