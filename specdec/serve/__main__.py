from specdec.serve import main

main()
