"""The TensorFlow 2 backend: ``backend.py`` (environment and launch, stdlib only), ``worker.py``
(the protocol's entry point), ``comm.py`` (ranks and collectives over a
MultiWorkerMirroredStrategy), ``models.py`` (backbones and torch's layouts), ``heads.py`` (the dp
margin-softmax head), ``step.py`` (the measured training step) and ``compiling.py`` (the time
it spends tracing and compiling, where TensorFlow does it)."""
