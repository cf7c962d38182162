"""Shipping a trained model: the bundle (`bundle`), the BraTS challenge entrypoint (`challenge`), the image
definition (`container`) and the organisers' checks of an output folder (`submission`)."""
