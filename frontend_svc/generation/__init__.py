"""One API call's engine requests: run and merge the sequences, the request fields that need the
model (token constraints), engine refusals as 400s."""
