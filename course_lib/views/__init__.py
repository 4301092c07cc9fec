"""Pictures and controls only: plots and its companions (plots_perf, plots_roofline, plots_kernels, plots_long),
html_views and widgets. Each takes data and draws it; none imports measure or runs a model it was not handed."""
