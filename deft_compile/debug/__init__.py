"""What users look at: graph dumps per pass, plan tables and JSON, Chrome traces, Gantt plots, TORCH_TRACE
artifacts."""
