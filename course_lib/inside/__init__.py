"""Inside the model (lessons 03 and 04): anatomy (parameters, shapes, the logit lens, a block by hand) and probes
(ablation and activation patching). Reads the runner; knows no loop."""
