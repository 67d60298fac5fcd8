"""Real data: MXNet RecordIO read and written without MXNet (``recordio``), insightface's and
im2rec's layouts (``layout``), packing image folders (``pack``), synthetic face datasets
(``synth``), JPEG decoders (``decode``), the torch input pipeline (``pipeline``) and its
stand-alone measurement (``bench``). Only ``pipeline`` and ``bench`` import torch."""
