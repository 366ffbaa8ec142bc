"""Data formats shared by data generation, training and analysis (no Lightning here): the
feature dump (`features`), batches and the drafter's shift (`batches`), token streams for
training an LM from scratch (`tokens`)."""
