module dispatcherclient

go 1.21
