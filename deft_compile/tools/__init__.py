"""What users run around the library: the ``deft-compile`` CLI, the demo and bench, shaped links, the
local launcher and the model presets."""
