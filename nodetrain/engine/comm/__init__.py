"""Communication of a rank: collectives and P2P on the device their group serves (``comm``), the
paired P2P of the pipeline (``p2p``) and the gradient sum across replicas (``replicas``)."""
