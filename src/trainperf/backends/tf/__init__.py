"""The TensorFlow 2 backend: ``backend.py`` (environment and launch, stdlib only), ``worker.py``
(the protocol's entry point), ``comm.py`` (ranks and collectives over a
MultiWorkerMirroredStrategy), ``models.py`` (backbones and torch's layouts), ``heads.py`` (the dp
margin-softmax head) and ``step.py`` (the measured training step)."""
